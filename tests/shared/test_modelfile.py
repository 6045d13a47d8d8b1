"""Choosing the served model (shared/modelfile.py), reading its header (shared/ggufmeta.py) and what
the stages take from it (shared/modelcard.py)."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from shared import ggufmeta, modelcard, modelfile
from shared.config import ConfigError
from shared.modelfile import shipped_gguf


def write_gguf(path, arch="llama", context=512, tokens=("<unk>", "<s>", "</s>", "<|im_end|>", "a", "b"),
               types=(2, 3, 3, 3, 1, 1), eos=2, template="{{ messages }}"):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("Tiny Test Model")
    w.add_context_length(context)
    w.add_uint32("test.u32", 7)
    w.add_int64("test.i64", -5)
    w.add_float64("test.f64", 0.25)
    w.add_bool("test.flag", True)
    w.add_array("test.floats", [0.5, 1.5])
    w.add_tokenizer_model("gpt2")
    w.add_token_list(list(tokens))
    w.add_token_types(list(types))
    w.add_eos_token_id(eos)
    if template:
        w.add_chat_template(template)
    w.add_tensor("token_embd.weight", np.arange(24, dtype=np.float32).reshape(6, 4))
    w.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_header_reader_agrees_with_gguf_py_on_the_shipped_model_and_every_value_type(tmp_path):
    for path in (shipped_gguf(), write_gguf(tmp_path / "t.gguf")):
        ours, ref = ggufmeta.read(path), gguf.GGUFReader(str(path))
        for key, field in ref.fields.items():
            if not key.startswith("GGUF."):
                assert ours.metadata[key] == pytest.approx(field.contents()), key
        assert {t.name: (int(t.tensor_type), int(t.data_offset)) for t in ref.tensors} == \
            {t.name: (t.ggml_type, t.offset) for t in ours.tensors.values()}
    header = ggufmeta.read(tmp_path / "t.gguf")
    assert header.tensors["token_embd.weight"].shape == (6, 4) and header.arch("context_length") == 512
    assert header.get("test.i64") == -5 and header.get("test.flag") is True


def test_a_file_that_is_not_a_gguf_or_is_cut_short_is_refused(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ggufmeta.GgufError, match="not a GGUF"):
        ggufmeta.read(tmp_path / "x.gguf")
    whole = (write_gguf(tmp_path / "t.gguf")).read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:200])
    with pytest.raises(ggufmeta.GgufError):
        ggufmeta.read(tmp_path / "cut.gguf")


def test_the_model_is_chosen_by_env_then_keel_yaml_then_the_shipped_file(tmp_path):
    layout = tmp_path / "keel.yaml"
    env = {"KEEL_KEEL_CONFIG": str(layout)}
    layout.write_text("model: {path: null}\n")
    assert modelfile.model_path(env) == shipped_gguf()
    assert modelfile.model_id(None, env) == "SmolLM2-135M-Instruct"
    mine = write_gguf(tmp_path / "Team-Model-7B-Q4_K_M.gguf")
    layout.write_text(f"model: {{path: {mine}}}\n")
    assert modelfile.model_path(env) == mine and modelfile.model_id(None, env) == "Team-Model-7B"
    other = write_gguf(tmp_path / "other.gguf", context=256)
    assert modelfile.model_path({**env, "KEEL_MODEL": str(other)}) == other
    assert modelfile.model_id(None, {**env, "KEEL_MODEL_NAME": "support-bot"}) == "support-bot"


def test_a_source_has_a_digest_of_its_bytes_and_a_key_per_model(tmp_path, monkeypatch):
    monkeypatch.setenv("KEEL_MODELS_DIR", str(tmp_path / "models"))
    a = modelfile.source(write_gguf(tmp_path / "a.gguf"), environ={})
    again = modelfile.source(tmp_path / "a.gguf", environ={})
    b = modelfile.source(write_gguf(tmp_path / "b.gguf", context=1024), environ={})
    assert a.digest == again.digest and a.digest != b.digest and a.key != b.key
    assert a.cache_dir.parent == tmp_path / "models" and a.kind == modelfile.GGUF


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing.gguf", "no file or folder"),
    (lambda p: (p / "x.bin").write_bytes(b"\0" * 8) and p / "x.bin", "is not a GGUF file"),
    (lambda p: (p / "folder").mkdir() or p / "folder", "is not a Hugging Face folder"),
])
def test_a_path_that_is_no_model_is_refused_naming_model_path(tmp_path, make, message):
    with pytest.raises(ConfigError, match=f"field 'model.path' breaks rule .*{message}"):
        modelfile.source(make(tmp_path), environ={})


def test_the_card_of_the_shipped_model_has_its_context_stop_ids_and_template():
    card = modelcard.read(modelfile.source(shipped_gguf(), environ={}))
    assert card.architecture == "llama" and card.context_tokens == 8192
    # <|im_end|> (2, the end-of-sequence id) and <|endoftext|> (0), as llama.cpp marks them
    assert card.stop_token_ids == (0, 2)
    assert card.chat_template and "<|im_start|>" in card.special_tokens


def test_the_card_of_a_gguf_takes_its_own_ids_and_says_when_there_is_no_template(tmp_path):
    card = modelcard.read(modelfile.source(write_gguf(tmp_path / "t.gguf", eos=1, template=None), environ={}))
    assert card.stop_token_ids == (1, 3) and card.chat_template is None and card.as_dict()["chat_template"] == "plain"
    (tmp_path / "noctx.gguf").write_bytes(b"")
    w = gguf.GGUFWriter(str(tmp_path / "noctx.gguf"), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="context_length"):
        modelcard.read(modelfile.source(tmp_path / "noctx.gguf", environ={}))


def test_the_card_of_a_folder_reads_its_config_and_tokenizer_files(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 32768,
                                                    "eos_token_id": 7}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{{ x }}", "eos_token": "<|im_end|>",
        "added_tokens_decoder": {"9": {"content": "<|im_end|>", "special": True},
                                 "11": {"content": "<|endoftext|>", "special": True}}}))
    card = modelcard.read(modelfile.source(folder, environ={}))
    assert (card.architecture, card.context_tokens, card.stop_token_ids) == ("qwen2", 32768, (7, 9, 11))
    assert card.source.model_id == "m" and card.chat_template == "{{ x }}"


def test_a_folder_moved_elsewhere_is_prepared_again_not_served_from_links_to_where_it_was(tmp_path, monkeypatch):
    """Same bytes, same key: the prepared folder's links pointed at the old path, gone since."""
    from services.inference.model import modelcache

    monkeypatch.setenv(modelfile.MODELS_DIR_ENV, str(tmp_path / "models"))
    first = tmp_path / "a" / "m"
    first.mkdir(parents=True)
    for name, text in (("config.json", '{"model_type": "llama"}'), ("model.safetensors", "w"),
                       ("tokenizer.json", "{}")):
        (first / name).write_text(text)
    out = modelcache.prepared(modelfile.source(first, environ={}))
    assert (out / "config.json").resolve() == first / "config.json"
    moved = tmp_path / "b" / "m"
    (tmp_path / "b").mkdir()
    first.rename(moved)
    again = modelcache.prepared(modelfile.source(moved, environ={}))
    assert again == out and (again / "config.json").resolve() == moved / "config.json"
    assert json.loads((again / "config.json").read_text()) == {"model_type": "llama"}
