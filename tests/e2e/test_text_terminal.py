"""``in=text`` on a real (pseudo-)terminal: the line editor, Ctrl-D and Ctrl-C end the session cleanly."""

from __future__ import annotations

import os
import select
import sys
import termios
import time

import pytest

from harness.proc import cli_command, cli_env

pty = pytest.importorskip("pty")


class Terminal:
    """``dynamo-run`` with a pty as its controlling terminal (so Ctrl-C sends SIGINT, as in a shell)."""

    def __init__(self, *args: str, delay_ms: int = 0):
        argv = cli_command() + list(args)
        env = cli_env(delay_ms=delay_ms)
        env["TERM"] = "xterm"
        env["PROMPT_TOOLKIT_NO_CPR"] = "1"  # nobody answers cursor-position requests on this pty
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child
            try:
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.output = b""

    def read_until(self, needle: bytes, timeout: float = 15.0) -> bytes:
        deadline = time.monotonic() + timeout
        while needle not in self.output and time.monotonic() < deadline:
            ready, _, _ = select.select([self.fd], [], [], 0.05)
            if ready:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                self.output += chunk
        return self.output

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait_for_line_editor(self, active: bool = True, timeout: float = 15.0) -> None:
        """Wait until the terminal is in raw mode (the line editor reads keys) or back in cooked mode.

        Keys typed before the switch would be interpreted by the other mode (Ctrl-D as end-of-file of a
        cooked read, Ctrl-C as a key instead of SIGINT), so each test waits for the mode it means.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lflag = termios.tcgetattr(self.fd)[3]
            raw = not (lflag & termios.ICANON) and not (lflag & termios.ISIG)
            if raw == active:
                return
            self.read_until(b"\x00never", timeout=0.01)
        raise AssertionError(f"terminal mode never became {'raw' if active else 'cooked'}: {self.output[-500:]!r}")

    def wait(self, timeout: float = 15.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.read_until(b"\x00never", timeout=0.05)  # keep draining so the child never blocks
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        self.kill()
        raise AssertionError(f"dynamo-run did not exit; output so far: {self.output[-2000:]!r}")

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


@pytest.fixture
def term_factory():
    terms: list[Terminal] = []

    def make(*args: str, delay_ms: int = 0) -> Terminal:
        t = Terminal(*args, delay_ms=delay_ms)
        terms.append(t)
        return t

    yield make
    for t in terms:
        t.kill()


pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pty")


def test_chat_then_ctrl_d_exits_zero(term_factory):
    t = term_factory("out=echo_full")
    t.read_until(b"User")
    t.wait_for_line_editor()
    t.send(b"hello terminal\r")
    out = t.read_until(b"hello terminal\r\n")  # the answer, after the typed line's own echo
    assert out.count(b"hello terminal") >= 2
    t.read_until(b"User", timeout=5)
    t.wait_for_line_editor()
    t.send(b"\x04")  # Ctrl-D at the prompt
    assert t.wait() == 0
    assert b"Traceback" not in t.output


def test_ctrl_c_at_the_prompt_exits_zero(term_factory):
    t = term_factory("out=echo_full")
    t.read_until(b"User")
    t.wait_for_line_editor()
    t.send(b"\x03")
    assert t.wait() == 0
    assert b"Traceback" not in t.output


def test_ctrl_c_during_an_answer_stops_it_after_an_earlier_turn(term_factory):
    # a first turn runs the line editor once: its SIGINT handling must not swallow a later Ctrl-C
    t = term_factory("out=echo_full", delay_ms=50)
    t.read_until(b"User")
    t.wait_for_line_editor()
    t.send(b"ok\r")
    t.read_until(b"ok\r\n")
    t.read_until(b"User", timeout=5)
    t.wait_for_line_editor()
    t.output = b""
    long_text = b"abcdefghij" * 20  # 200 characters: ten seconds of answer
    t.send(long_text + b"\r")
    started = b"\x1b[?2004l" + long_text[:5]  # the line editor let go and the answer is streaming
    t.read_until(started)
    t.wait_for_line_editor(active=False)
    t.send(b"\x03")
    assert t.wait() == 0
    assert b"Traceback" not in t.output
    answer = t.output[t.output.index(started) + len(b"\x1b[?2004l"):]
    assert b"^C" in answer or b"SIGINT" in answer
    assert long_text not in answer  # cut short
