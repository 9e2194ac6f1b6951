"""benchmarks/peer_llamacpp.py without llama.cpp: the driver's line protocol (against a stand-in
driver process), the agreement of greedy tokens and the side-by-side table, by hand."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

from etjax.errors import EtjaxError

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "peer_llamacpp.py"
_SPEC = importlib.util.spec_from_file_location("peer_llamacpp", _PATH)
peer = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = peer  # its dataclasses look their module up there
_SPEC.loader.exec_module(peer)

READY = {
    "ready": True,
    "llama_cpp": {"repo": "ggml-org/llama.cpp", "release": "v0.5.0"},
    "cpu_variant": ["libggml-cpu-zen4.so"],
    "system_info": "CPU : AVX2 = 1 | ",
}


def _stand_in(tmp_path: Path, body: str) -> list[str]:
    # A driver process speaking the protocol: the ready line, then `body` per request line.
    script = tmp_path / "driver.py"
    script.write_text(
        "import json, sys\n"
        f"print(json.dumps({READY!r}), flush=True)\n"
        "for line in sys.stdin:\n"
        "    request = json.loads(line)\n" + textwrap.indent(textwrap.dedent(body), "    ")
    )
    return [sys.executable, "-I", "-S", str(script)]  # no site: a quick start


def test_the_driver_answers_prefill_and_decode_requests_line_by_line(tmp_path):
    body = """
    if request["op"] == "prefill":
        reply = {"seconds": 0.5, "token": len(request["tokens"])}
    else:
        n = request["new_tokens"]
        reply = {"seconds": 2.0, "tokens": [[p[0]] * n for p in request["prompts"]]}
    print(json.dumps(reply), flush=True)
    """
    with peer.LlamaCppDriver(_stand_in(tmp_path, body)) as driver:
        assert driver.info["cpu_variant"] == ["libggml-cpu-zen4.so"]
        # One new token of one prompt is a prefill: the driver's first token comes back.
        assert driver.generate([[7, 8, 9]], 1) == (0.5, [[3]])
        assert driver.generate([[4, 5], [6]], 3) == (2.0, [[4, 4, 4], [6, 6, 6]])
    assert driver.process.returncode == 0


def test_a_failing_driver_is_an_error_naming_its_reason(tmp_path):
    body = 'print(json.dumps({"error": "Failed to load model"}), flush=True); break'
    with (
        peer.LlamaCppDriver(_stand_in(tmp_path, body)) as driver,
        pytest.raises(EtjaxError, match="driver failed: Failed to load model"),
    ):
        driver.generate([[1]], 1)


def test_a_driver_that_exits_without_replying_is_an_error(tmp_path):
    with (
        peer.LlamaCppDriver(_stand_in(tmp_path, "sys.exit(3)")) as driver,
        pytest.raises(EtjaxError, match="exited without replying"),
    ):
        driver.generate([[1, 2]], 4)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("Segmentation fault\n", "not a JSON line"),
        ("[1, 2]\n", "expected a JSON object"),
        ('{"seconds": 1.0}\n', r"lacks \['tokens'\]"),
    ],
)
def test_a_reply_that_is_not_the_protocol_is_refused(line, message):
    with pytest.raises(EtjaxError, match=message):
        peer.parse_reply(line, ("seconds", "tokens"))


def test_agreement_counts_identical_rows_and_the_shortest_common_prefix():
    ours = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    theirs = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
    found = peer.agreement(ours, theirs)
    assert found == peer.Agreement(rows=3, identical=1, shortest=0, length=4)
    assert str(found) == "1 of 3 rows; shortest 0 of 4"
    assert str(peer.agreement([[1, 2, 3]], [[1, 2, 4]])) == "2 of 3"
    with pytest.raises(EtjaxError, match="2 rows against 1"):
        peer.agreement([[1], [2]], [[1]])


def _raw() -> dict:
    # etjax float32 decodes 256 tokens in 1, 2 and 4 s (256, 128, 64 tok/s: median 128);
    # llama.cpp in 4 s each (64 tok/s): the ratio of medians is 2.00x.
    rows = {}
    for key, _ in peer.ROWS:
        rows[key] = {
            "tokens": 256,
            "first_call_s": {"float32": 12.34, peer.LLAMACPP: 0.2},
            "seconds": {"float32": [2.0, 1.0, 4.0], peer.LLAMACPP: [4.0, 4.0, 4.0]},
            "outputs": {"float32": [[1, 2, 3], [4, 5, 6]], peer.LLAMACPP: [[1, 2, 3], [4, 0, 6]]},
        }
    return {
        "machine": "AMD EPYC (AVX2, AVX-512), 2 cores, Python 3.11, JAX 0.10.2 (cpu)",
        "date": "2026-12-06",
        "command": "benchmarks/peer_llamacpp.py",
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "weights": ["float32"],
        "threads": 2,
        "llama_cpp": {**READY, "node_llama_cpp": "3.22.1", "batch_size": {"prefill": 512}},
        "resident_weight_mb": {"float32": 538.0},
        "other_cores": 0.8,
        "rows": rows,
    }


def test_the_table_has_rates_ratios_first_calls_and_agreement_per_measurement():
    lines = peer.report(_raw()).splitlines()
    table = [line for line in lines if line.startswith("|")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header == [
        "measurement",
        "etjax float32 tok/s",
        "llama.cpp tok/s",
        "float32 / llama.cpp",
        "etjax float32 first call s",
        "greedy tokens agree (float32)",
    ]
    assert table[1] == "|---" * len(header) + "|"
    body = [[cell.strip() for cell in row.strip("|").split("|")] for row in table[2:]]
    assert [row[0] for row in body] == [title for _, title in peer.ROWS]
    for row in body:
        assert row[1:] == [
            "128 (64-256)",
            "64 (64-64)",
            "2.00x",
            "12.3",
            "1 of 2 rows; shortest 1 of 3",
        ]
    text = "\n".join(lines)
    assert "**measured under load**" in text
    assert "CPU variant libggml-cpu-zen4.so" in text
    assert "ggml-org/llama.cpp v0.5.0" in text


def test_load_options_pass_the_format_as_load_model_takes_it():
    def before(path, *, dtype="auto"): ...

    def after(path, *, dtype="auto", weights="auto"): ...

    assert peer.load_options(before, "float32") == {"dtype": "float32"}
    assert peer.load_options(after, "stored") == {"dtype": "float32", "weights": "stored"}
    with pytest.raises(EtjaxError, match=r"'stored'.*allowed here: float32, bfloat16"):
        peer.load_options(before, "stored")


def test_the_workload_is_one_document_and_eight_prompts_of_the_same_ids():
    class Characters:  # a tokenizer of one id per character
        def encode(self, text):
            return [ord(c) for c in text]

    work = peer.workload(Characters(), ["abcdefghij" * 100] * 8)
    assert [len(p) for p in work["prefill"]] == [peer.DOCUMENT_TOKENS]
    assert [len(p) for p in work["decode_8"]] == [peer.PROMPT_TOKENS] * 8
    assert work["decode_1"] == work["decode_8"][:1]
    with pytest.raises(EtjaxError, match="gave 17 tokens; need 2048"):
        peer.workload(Characters(), ["abcdefgh", "abcdefgh"])
