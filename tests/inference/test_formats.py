"""Weight formats: weight-only int8/int4 modules, conversion, and the row invariance of each format."""
from __future__ import annotations

import pytest
import torch

from services.inference.model.loader import convert_model
from services.inference.model.quant import Int4Linear, Int8Linear, quantize_linears
from shared.errors import InvalidInput


def _linear(seed: int = 0, k: int = 256, n: int = 320) -> torch.nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data = torch.randn(n, k, generator=gen) * 0.05
    return lin.requires_grad_(False)


# Keel's own weight-only modules. aten's bfloat16 Linear is left out: whether its rows are
# batch-invariant depends on the CPU's kernels, so `auto` measures it on the host at hand
# (test_formats_gate.py: a format whose step is not invariant is refused).
FORMATS = {
    "int8": Int8Linear,
    "int4": Int4Linear,
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_are_bitwise_the_same_alone_and_in_any_batch(fmt, threads):
    lin = FORMATS[fmt](_linear())
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            alone = [lin(x[r:r + 1]) for r in range(17)]
            for m in range(1, 18):
                batch = lin(x[:m])
                assert all(torch.equal(batch[r:r + 1], alone[r]) for r in range(m)), f"M={m}"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("cls,max_rel_error", [(Int8Linear, 0.02), (Int4Linear, 0.15)])
def test_weight_only_output_tracks_the_float_layer(cls, max_rel_error):
    lin = _linear(2)
    x = torch.randn(8, 256)
    ref, out = lin(x), cls(lin)(x)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert float((out - ref).norm() / ref.norm()) < max_rel_error


def test_int8_dequantizes_to_within_one_step_per_channel():
    # Half a step of rounding plus the bfloat16 rounding of the scale (at most 127 * 2**-9 steps).
    lin = _linear(3)
    step = lin.weight.abs().amax(dim=1, keepdim=True) / 127
    q = Int8Linear(lin)
    dequantized = q.qweight.float() * q.scales.float()[:, None]
    assert bool(((dequantized - lin.weight).abs() <= step).all())


def test_bias_is_applied():
    lin = torch.nn.Linear(64, 32).requires_grad_(False)
    with torch.no_grad():
        lin.bias.fill_(3.0)
    x = torch.randn(2, 64)
    assert float((Int8Linear(lin)(x) - lin(x)).abs().max()) < 0.1


def test_int4_needs_whole_groups():
    with pytest.raises(ValueError, match="group size"):
        Int4Linear(torch.nn.Linear(48, 16), group_size=32)


@pytest.mark.parametrize("fmt,cls,min_cosine", [("int8", Int8Linear, 0.99), ("int4", Int4Linear, 0.5)])
def test_conversion_swaps_every_linear_including_lm_head(tiny, fmt, cls, min_cosine):
    model = convert_model(tiny, fmt)
    assert model is not tiny and model.format == fmt and tiny.format == "float32"
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, cls)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the residual stream stays float32
    ids = torch.tensor([[5, 17, 300, 4000, 9]])
    with torch.inference_mode():
        ref, out = tiny(ids).logits, model(ids).logits
    cos = torch.nn.functional.cosine_similarity(ref.flatten(), out.flatten(), dim=0)
    assert float(cos) > min_cosine  # the tiny model's wide random weights are int4's worst case; broken is ~0


def test_weight_only_layers_store_fewer_bytes_than_float32():
    lin = _linear(4)
    fp32 = sum(t.nbytes for t in lin.parameters())
    int8 = sum(t.nbytes for t in Int8Linear(lin).buffers())
    int4 = sum(t.nbytes for t in Int4Linear(lin).buffers())
    assert int4 < int8 < fp32 / 3


def test_quantized_models_cannot_be_converted_again(tiny):
    with pytest.raises(InvalidInput) as err:
        convert_model(convert_model(tiny, "int4"), "float32")
    assert err.value.reason == "UNSUPPORTED_FORMAT"


@pytest.mark.parametrize("fmt,device,reason", [("int2", "cpu", "UNKNOWN_FORMAT"), ("auto", "cpu", "UNKNOWN_FORMAT"),
                                                 ("int4", "cuda", "UNSUPPORTED_FORMAT")])
def test_bad_format_is_refused(tiny, fmt, device, reason):
    with pytest.raises(InvalidInput) as err:
        convert_model(tiny, fmt, device)
    assert err.value.reason == reason


def test_quantize_linears_rejects_unknown_format(tiny):
    with pytest.raises(ValueError, match="int3"):
        quantize_linears(tiny, "int3")


def test_the_config_schema_names_exactly_the_formats_the_loader_knows():
    """A format the loader serves but the schema lacks would stop the stage at config load."""
    import json

    from services.inference.model.loader import AUTO, FORMATS
    from shared.config import ROOT_DIR

    schema = json.loads((ROOT_DIR / "config" / "schemas" / "inference.schema.json").read_text())
    engine, formats = schema["properties"]["engine"]["properties"], schema["properties"]["formats"]["properties"]
    assert engine["format"]["enum"] == [AUTO, *FORMATS]
    assert engine["breaker"]["properties"]["fallback_format"]["enum"] == [*FORMATS, None]
    assert formats["auto_candidates"]["items"]["enum"] == list(FORMATS)
    assert engine["variants"]["additionalProperties"]["enum"] == list(FORMATS)
