"""``dynamo-run`` as a user runs it from a shell: pipes, files, exit codes, and what lands on each stream."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from harness.proc import cli_command, cli_env, run_cli

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


def assert_one_line_error(proc, *needles: str) -> None:
    """Failed with a single readable line on stderr: no traceback, nothing on stdout."""
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr
    assert len(err.splitlines()) == 1, proc.stderr
    assert err.startswith("Error:"), err
    for needle in needles:
        assert needle in err, err
    assert proc.stdout.strip() == ""


# -- stdin -----------------------------------------------------------------------------------------


def test_piped_prompt_is_echoed_by_echo_full():
    p = run_cli(["out=echo_full"], input="hi there\n")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("hi there\n")
    assert p.stdout.strip() == "hi there"


def test_explicit_in_stdin_with_echo_core_shows_the_template(tiny_model: Path):
    p = run_cli(["in=stdin", "out=echo_core", str(tiny_model)], input="What is 2 + 2?")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == (SYSTEM + "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant").strip()


def test_multibyte_prompt_round_trips_through_stdin(tiny_model: Path):
    text = "Привет, мир! 🙂 日本語"
    p = run_cli(["out=echo_core", str(tiny_model)], input=text)
    assert p.returncode == 0, p.stderr
    assert f"user\n{text}<|im_end|>" in p.stdout
    assert "\ufffd" not in p.stdout


def test_empty_stdin_is_an_error():
    p = run_cli(["out=echo_full"], input="")
    assert_one_line_error(p, "stdin")


def test_prompt_text_is_not_logged_at_info(tiny_model: Path):
    secret = "my-very-private-prompt-7731"
    p = run_cli(["out=echo_core", str(tiny_model)], input=secret)
    assert p.returncode == 0
    assert secret in p.stdout
    assert secret not in p.stderr


def test_verbose_flag_enables_debug_logs():
    quiet = run_cli(["out=echo_full"], input="x")
    loud = run_cli(["out=echo_full", "-v"], input="x")
    assert quiet.returncode == loud.returncode == 0
    assert "DEBUG" not in quiet.stderr
    assert "DEBUG" in loud.stderr


def test_dyn_log_filters_by_module():
    p = run_cli(["out=echo_full"], input="x", env={"DYN_LOG": "debug"})
    assert p.returncode == 0
    assert "DEBUG dynamo.cli" in p.stderr
    p = run_cli(["out=echo_full"], input="x", env={"DYN_LOG": "warn,dynamo.cli=debug"})
    assert "DEBUG dynamo.cli" in p.stderr
    p = run_cli(["out=echo_full"], input="x", env={"DYN_LOG": "debug,dynamo.cli=info"})
    assert "DEBUG dynamo.cli" not in p.stderr


@pytest.mark.parametrize("mode", ["in=stdin", "in=text"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_while_waiting_for_stdin_exits(mode, sig):
    # stdin is a pipe nobody writes to: the process must still go when told to
    proc = subprocess.Popen(cli_command() + [mode, "out=echo_full", "-v"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env())
    try:
        # the debug line about the model is logged after the signal handlers are in place
        deadline = time.monotonic() + 20
        seen = b""
        while b"engine echo_full" not in seen and time.monotonic() < deadline:
            seen += proc.stderr.readline()
        assert b"engine echo_full" in seen, seen
        proc.send_signal(sig)
        proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()
    rest = proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    assert proc.returncode not in (-signal.SIGTERM, -signal.SIGINT)  # handled, not killed by the signal
    assert b"Traceback" not in seen + rest
    assert b"Fatal Python error" not in rest


# -- text ------------------------------------------------------------------------------------------


def test_text_mode_keeps_the_conversation(tiny_model: Path):
    p = run_cli(["in=text", "out=echo_core", str(tiny_model)], input="first question\nsecond question\n")
    assert p.returncode == 0, p.stderr
    first_answer = SYSTEM + "<|im_start|>user\nfirst question<|im_end|>\n<|im_start|>assistant\n"
    # the second answer echoes a prompt holding the first turn and the first answer
    second_answer = (
        SYSTEM + "<|im_start|>user\nfirst question<|im_end|>\n"
        f"<|im_start|>assistant\n{first_answer}<|im_end|>\n"
        "<|im_start|>user\nsecond question<|im_end|>\n<|im_start|>assistant\n"
    )
    assert p.stdout.startswith(first_answer)
    assert second_answer in p.stdout
    assert p.stdout.count("first question") == 3
    assert p.stdout.count("second question") == 1


def test_text_mode_with_echo_full_answers_each_line():
    p = run_cli(["in=text", "out=echo_full"], input="one\n\ntwo\n")
    assert p.returncode == 0, p.stderr
    assert [line for line in p.stdout.splitlines() if line] == ["one", "two"]


# -- batch -----------------------------------------------------------------------------------------


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def test_batch_writes_output_beside_the_input(tmp_path: Path, tiny_model: Path):
    src = write_jsonl(tmp_path / "prompts.jsonl", [{"text": "hello"}, "", {"text": "café 🙂", "id": 7}])
    p = run_cli([f"in=batch:{src}", "out=echo_core", str(tiny_model)])
    assert p.returncode == 0, p.stderr
    out = tmp_path / "output.jsonl"
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert sorted(r["text"] for r in rows) == ["café 🙂", "hello"]
    for r in rows:
        assert set(r) >= {"text", "response", "tokens_in", "tokens_out", "elapsed_ms", "finish_reason"}
        assert r["response"] == SYSTEM + f"<|im_start|>user\n{r['text']}<|im_end|>\n<|im_start|>assistant\n"
        assert r["tokens_in"] > 0 and r["tokens_out"] > 0
        assert isinstance(r["elapsed_ms"], int) and r["elapsed_ms"] >= 0
        assert r["finish_reason"] == "stop"
    assert "Ran 2 of 2 prompts" in p.stderr
    assert "Tokens in:" in p.stderr and "Tokens out:" in p.stderr and "/s" in p.stderr
    assert "Traceback" not in p.stderr


def test_batch_results_are_written_in_completion_order(tmp_path: Path):
    # echo_full takes a (small) delay per character, so the short prompt finishes well before the long one
    src = write_jsonl(tmp_path / "p.jsonl", [{"text": "long " * 30}, {"text": "s"}])
    p = run_cli([f"in=batch:{src}", "out=echo_full"], delay_ms=5)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in (tmp_path / "output.jsonl").read_text().splitlines()]
    assert [r["text"] for r in rows] == ["s", "long " * 30]
    assert [r["response"] for r in rows] == ["s", "long " * 30]


def test_batch_failed_prompt_is_recorded_and_the_rest_still_run(tmp_path: Path, tiny_model: Path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"text": "hi"}, {"text": "a prompt far too long for the window " * 3}])
    p = run_cli([f"in=batch:{src}", "out=echo_core", str(tiny_model), "--context-length", "45"])
    assert p.returncode == 1
    assert "Traceback" not in p.stderr
    rows = {r["text"]: r for r in map(json.loads, (tmp_path / "output.jsonl").read_text().splitlines())}
    assert rows["hi"]["finish_reason"] == "length"  # max_tokens defaults to what is left of the 45
    assert rows["hi"]["tokens_in"] + rows["hi"]["tokens_out"] == 45
    failed = rows["a prompt far too long for the window " * 3]
    assert "maximum context length is 45 tokens" in failed["error"]
    assert "Ran 1 of 2 prompts" in p.stderr


def test_batch_output_replaces_an_old_output_file(tmp_path: Path):
    (tmp_path / "output.jsonl").write_text('{"stale": true}\n' * 5)
    src = write_jsonl(tmp_path / "p.jsonl", [{"text": "fresh"}])
    assert run_cli([f"in=batch:{src}", "out=echo_full"]).returncode == 0
    rows = [json.loads(line) for line in (tmp_path / "output.jsonl").read_text().splitlines()]
    assert [r["text"] for r in rows] == ["fresh"]


@pytest.mark.parametrize(
    "lines,needle",
    [
        ([{"text": "ok"}, "this is not json"], ":2: not valid JSON"),
        ([{"text": "ok"}, {"text": "ok"}, {"prompt": "wrong key"}], ':3: each line must be an object with a "text"'),
        ([{"text": 5}], ":1:"),
    ],
)
def test_batch_bad_line_is_reported_with_its_number(tmp_path: Path, lines, needle):
    src = write_jsonl(tmp_path / "bad.jsonl", lines)
    p = run_cli([f"in=batch:{src}", "out=echo_full"])
    assert_one_line_error(p, str(src), needle)
    assert not (tmp_path / "output.jsonl").exists()  # nothing ran


def test_batch_missing_file(tmp_path: Path):
    p = run_cli([f"in=batch:{tmp_path / 'nope.jsonl'}", "out=echo_full"])
    assert_one_line_error(p, "Missing or not a file")


def test_batch_empty_file(tmp_path: Path):
    src = tmp_path / "empty.jsonl"
    src.write_text("\n\n")
    assert_one_line_error(run_cli([f"in=batch:{src}", "out=echo_full"]), "no prompts")


# -- help, version, alias ----------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--help"], ["-h"], [], ["-v"]])
def test_help_explains_inputs_and_engines(argv):
    p = run_cli(argv)
    assert p.returncode == 0
    for word in ("in=", "out=", "text", "stdin", "http", "batch:", "echo_full", "echo_core", "--http-port",
                 "--model-name", "--context-length", "--router-mode", "DYN_LOG"):
        assert word in p.stdout, word


def test_version():
    p = run_cli(["--version"])
    assert p.returncode == 0
    assert p.stdout.startswith("dynamo-run ")


def test_dynamo_run_alias():
    p = run_cli(["run", "out=echo_full"], input="via the umbrella command", program="dynamo")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "via the umbrella command"
    help_ = run_cli(["run", "--help"], program="dynamo")
    assert help_.returncode == 0 and "echo_core" in help_.stdout


def test_dynamo_unknown_subcommand():
    p = run_cli(["walk"], program="dynamo")
    assert_one_line_error(p, "walk")


# -- errors the user must fix --------------------------------------------------------------------------


def test_unknown_flag():
    assert_one_line_error(run_cli(["out=echo_full", "--bogus"], input="x"), "--bogus")


def test_bad_in_and_out_values():
    assert_one_line_error(run_cli(["in=carrier-pigeon", "out=echo_full"]), "Invalid in= option 'carrier-pigeon'")
    assert_one_line_error(run_cli(["out=telepathy"], input="x"), "Invalid out= option 'telepathy'")


def test_missing_model_folder(tmp_path: Path):
    p = run_cli(["out=echo_core", str(tmp_path / "no-such-model")], input="x")
    assert_one_line_error(p, "no-such-model")


def test_folder_without_tokenizer_json(tmp_path: Path, tiny_model: Path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_model / "config.json").read_text())
    p = run_cli(["out=echo_core", str(folder)], input="x")
    assert_one_line_error(p, "tokenizer.json")


def test_echo_core_without_a_model():
    assert_one_line_error(run_cli(["out=echo_core"], input="x"), "tokenizer")


def test_context_length_larger_than_the_model(tiny_model: Path):
    p = run_cli(["out=echo_core", str(tiny_model), "--context-length", "999999"], input="x")
    assert_one_line_error(p, "context length")


def test_prompt_over_the_context_length(tiny_model: Path):
    p = run_cli(["out=echo_core", str(tiny_model), "--context-length", "16"], input="a long prompt " * 10)
    assert p.returncode != 0
    assert "maximum context length is 16 tokens" in p.stderr
    assert "Traceback" not in p.stderr


def test_worker_only_flag_on_a_frontend():
    assert_one_line_error(run_cli(["in=http", "out=dyn", "--context-length", "10"]), "worker")


def test_http_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        p = run_cli(["in=http", "out=echo_full", "--http-host", "127.0.0.1", "--http-port", str(port)])
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    assert f"127.0.0.1:{port}" in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("Error:")
