"""keel tokenize / keel detokenize: JSON lines through the stage's code, bad lines reported in place."""
from __future__ import annotations

import io
import json

from services.tokenizer.cli import detokenize_main, tokenize_main


def run(main, argv, lines, binary=False):
    data = "".join(lines)
    stdin = io.BytesIO(data.encode("utf-8", "surrogatepass")) if binary else io.StringIO(data)
    out = io.StringIO()
    code = main(argv, stdin, out)
    return code, [json.loads(line) for line in out.getvalue().splitlines()]


def test_tokenize_lines(compiled_file, ref_ids):
    texts = ["Hello, world!", "中文 x  1", "<|im_start|>user\nhi<|im_end|>"]
    code, replies = run(tokenize_main, ["--compiled", str(compiled_file)],
                        [json.dumps({"text": t}) + "\n" for t in texts])
    assert code == 0
    assert replies == [{"ids": ref_ids(t)} for t in texts]


def test_tokenize_reports_bad_lines_and_goes_on(compiled_file, ref_ids):
    lines = ['{"text": "ok"}\n', "not json\n", '{"txt": "x"}\n', '{"text": ""}\n', "[1, 2]\n",
             '{"text": 5}\n', '{"text": "\\ud800"}\n', "\n", '{"text": "last"}\n']
    code, replies = run(tokenize_main, ["--compiled", str(compiled_file)], lines)
    assert code == 1
    reasons = [r["error"]["reason"] if "error" in r else r["ids"] for r in replies]
    assert reasons == [ref_ids("ok"), "INVALID_JSON", "INVALID_REQUEST", "EMPTY_INPUT", "INVALID_REQUEST",
                       "INVALID_REQUEST", "INVALID_UTF8", ref_ids("last")]  # the blank line is skipped
    assert all(r["error"]["message"] for r in replies if "error" in r)


def test_tokenize_binary_stdin_with_invalid_utf8(compiled_file):
    stdin = io.BytesIO(b'{"text": "a"}\n{"text": "\xff"}\n{"text": "b"}\n')
    out = io.StringIO()
    assert tokenize_main(["--compiled", str(compiled_file)], stdin, out) == 1
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [("error" in r) for r in replies] == [False, True, False]
    assert replies[1]["error"]["reason"] == "INVALID_UTF8"


def test_detokenize_lines(compiled_file, ref_ids):
    ids = ref_ids("<|im_start|>héllo 世界<|im_end|>")
    code, replies = run(detokenize_main, ["--compiled", str(compiled_file)], [json.dumps({"ids": ids}) + "\n"])
    assert (code, replies) == (0, [{"text": "<|im_start|>héllo 世界<|im_end|>"}])
    code, replies = run(detokenize_main, ["--compiled", str(compiled_file), "--skip-special-tokens"],
                        [json.dumps({"ids": ids}) + "\n"])
    assert (code, replies) == (0, [{"text": "héllo 世界"}])


def test_detokenize_reports_bad_lines_and_goes_on(compiled_file, reference):
    lines = ['{"ids": [28]}\n', '{"ids": [49152]}\n', '{"ids": [-1]}\n', '{"ids": [1.5]}\n',
             '{"ids": "28"}\n', '{"text": "x"}\n', '{"ids": []}\n']
    code, replies = run(detokenize_main, ["--compiled", str(compiled_file)], lines)
    assert code == 1
    assert [r.get("text", r.get("error", {}).get("reason")) for r in replies] == [
        reference.decode([28]), "TOKEN_ID_OUT_OF_RANGE", "TOKEN_ID_OUT_OF_RANGE", "INVALID_TOKEN_ID", "INVALID_REQUEST",
        "INVALID_REQUEST", ""]


def test_round_trip_through_both_commands(compiled_file):
    texts = ["multi\nline\ttext", "emoji 👩\u200d💻 and ٣ digits"]
    _, ids = run(tokenize_main, ["--compiled", str(compiled_file)], [json.dumps({"text": t}) + "\n" for t in texts])
    _, back = run(detokenize_main, ["--compiled", str(compiled_file)], [json.dumps(r) + "\n" for r in ids])
    assert [r["text"] for r in back] == texts


def test_unusable_tokenizer_file_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.kvoc"
    bad.write_bytes(b"nope")
    assert tokenize_main(["--compiled", str(bad)], io.StringIO('{"text": "x"}\n'), io.StringIO()) == 2
    assert "COMPILED_FILE" in capsys.readouterr().err


def test_bad_arguments_exit_2(capsys):
    assert tokenize_main(["--no-such-flag"], io.StringIO(), io.StringIO()) == 2
    assert "usage" in capsys.readouterr().err
