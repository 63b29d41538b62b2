"""Drive `pulsar-host run --chat` through a pseudo-terminal as a person would:
type a message, stop the reply with Ctrl-C, Ctrl-C at the prompt, /help,
/clear, recall a line with the up arrow, /bye. Exits non-zero on the first
expectation not met, printing what the terminal showed.

Usage: python3 repl_pty.py BIN MODEL PLUGIN_DIR STATE_DIR
"""
import os
import pty
import select
import sys
import time

BIN, MODEL, PLUGINS, STATE = sys.argv[1:5]

pid, fd = pty.fork()
if pid == 0:
    os.environ["XDG_STATE_HOME"] = STATE
    os.environ.pop("PULSAR_CONFIG", None)
    args = [BIN, "run", "-m", MODEL, "--chat", "--ignore-eos", "--device", "cpu", "--ctx", "4096", "--plugin-dir", PLUGINS]
    os.execv(BIN, args)

seen = b""
pos = 0  # where the next expectation starts looking


def fail(why):
    sys.stderr.write(f"FAIL: {why}\n--- the terminal showed ---\n{seen.decode(errors='replace')}\n")
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
    sys.exit(1)


def expect(text, timeout=60.0):
    """Read until `text` appears after the current mark; return what came."""
    global seen, pos
    want = text.encode()
    start = pos
    deadline = time.time() + timeout
    while want not in seen[start:]:
        left = deadline - time.time()
        if left <= 0:
            fail(f"no {text!r} within {timeout} s")
        r, _, _ = select.select([fd], [], [], left)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                fail(f"the chat ended before {text!r}")
            if not chunk:
                fail(f"the chat ended before {text!r}")
            seen += chunk
    end = seen.index(want, start) + len(want)
    pos = end
    return seen[start:end]


def send(s):
    os.write(fd, s.encode())


expect("> ")
send("/help\r")
expect("/clear")
expect("> ")
# A reply to stop: --ignore-eos keeps the random model talking until Ctrl-C.
send("tell me a long story\r")
expect("tell me a long story")
time.sleep(1.0)
send("\x03")
expect("[stopped]")
expect("> ")
# Ctrl-C at the prompt clears the line and keeps the chat.
send("half a line\x03")
expect("> ")
send("/clear\r")
expect("(conversation cleared)")
expect("> ")
# The up arrow brings back the last line (/clear), Enter runs it again.
send("\x1b[A")
expect("/clear")
send("\r")
expect("(conversation cleared)")
expect("> ")
send("/bye\r")
deadline = time.time() + 30
while time.time() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    try:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            seen += os.read(fd, 4096)
    except OSError:
        pass
else:
    fail("still running 30 s after /bye")
if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
    fail(f"exit status {status} after /bye")
history = os.path.join(STATE, "pulsar", "chat_history")
if not os.path.isfile(history) or "tell me a long story" not in open(history, encoding="utf-8", errors="replace").read():
    fail(f"{history} does not hold the message")
print("ok: type, Ctrl-C stops the reply, Ctrl-C at the prompt, /help, /clear, up arrow, /bye, history kept")
