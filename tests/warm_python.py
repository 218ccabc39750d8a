"""`python -m shardstream...`, `python -c CODE ...` or the `shardstream` script, run in a process forked from a warm
interpreter.

A fresh interpreter spends seconds importing torch and transformers before a command parses its first option,
and the suite runs a few hundred commands. `run()` and `popen()` take subprocess.run's and subprocess.Popen's
arguments for such a command and run it in a child forked from one server per test process, which has imported
torch and transformers once. The child is a real process: its own pid, working folder, environment, standard
streams, exit status, signals, threads and atexit handlers, and a SIGKILL on timeout. It starts where a fresh
interpreter stands after those imports.

What is read while importing is the server's. So a command whose environment differs from the server's in
anything but SHARDSTREAM_* switches (read at each use), pytest's name of the running test and a PYTHONPATH of
folders already on the server's path (the child puts them first, as a fresh interpreter would) runs in a fresh
interpreter, as does any other command, and any call with an option these do not take. Tests of what a command
imports as it starts, of its memory under a cap, or of its command line as other processes read it use subprocess.
"""

from __future__ import annotations

import atexit
import ctypes
import io
import json
import locale
import os
import runpy
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types

# shardstream's package (it sets OpenMP's wait policy before torch loads), then third-party modules only:
# shardstream's modules build tables with torch as they are imported, and the OpenMP threads that starts do not
# survive a fork (the child would wait at their barrier for ever).
PRELOAD = ("shardstream", "torch", "safetensors.torch", "transformers", "transformers.modeling_utils",
           "transformers.generation", "transformers.conversion_mapping", "transformers.models.llama.modeling_llama")
_SWITCH_PREFIX = "SHARDSTREAM_"
_READ_LATER = {"PYTEST_CURRENT_TEST",   # set by pytest for each test; nothing reads it while importing
               "PYTHONUNBUFFERED",     # read as the standard streams are made, which the child does itself
               "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"}   # set by torch in the test process: a pointer of its own
_TAKEN = {"stdin", "stdout", "stderr", "text", "cwd", "env", "start_new_session"}
SCRIPT = os.path.join(os.path.dirname(sys.executable), "shardstream")   # the console script, as a user runs it
_PR_SET_PDEATHSIG = 1
_HEADER = struct.Struct("!I")


class _Server:
    def __init__(self) -> None:
        self.owner = os.getpid()   # the test process it serves (a fork of that process starts its own)
        self.folder = tempfile.mkdtemp(prefix="warm-python-")
        self.path = os.path.join(self.folder, "socket")
        self.environ = dict(os.environ)
        self.log = open(os.path.join(self.folder, "log"), "w+")
        self.process = subprocess.Popen([sys.executable, __file__, self.path], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True)
        ready = next((line for line in self.process.stdout if line.startswith("ready ")), None)
        if ready is None:
            self.process.wait()
            self.log.seek(0)
            raise RuntimeError(f"the warm interpreter did not start: {self.log.read()[-2000:]}")
        self.path_folders = {os.path.abspath(folder) for folder in json.loads(ready[len("ready "):])[1:]}
        atexit.register(self.stop)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def serves(self, environ: dict[str, str], cwd: str, first: str) -> bool:
        """Whether a command started in `cwd` with `environ`, `first` on its path, imports what the server did."""
        keys, known = set(environ) | set(self.environ), {*self.path_folders, first}
        return all(environ.get(k) == self.environ.get(k) for k in keys
                   if not k.startswith(_SWITCH_PREFIX) and k not in _READ_LATER and k != "PYTHONPATH") \
            and all(os.path.normpath(os.path.join(cwd, folder)) in known for folder in _folders(environ))


def _folders(environ: dict[str, str]) -> list[str]:
    """The folders PYTHONPATH puts on a fresh interpreter's path (an empty entry is the working folder)."""
    given = environ.get("PYTHONPATH", "")
    return [os.path.normpath(folder) for folder in given.split(os.pathsep)] if given else []


_server: _Server | None = None


def _warm_server() -> _Server:
    global _server
    if _server is None or _server.owner != os.getpid():
        _server = _Server()
    return _server


def _environment(env) -> dict[str, str]:
    return dict(os.environ) if env is None else {str(k): str(v) for k, v in env.items()}


def _warm(args: list[str], options: dict, environ: dict[str, str]) -> bool:
    """Whether the command can run forked from the warm server and be the same as run afresh."""
    command = args[:1] == [SCRIPT] or (len(args) >= 3 and args[0] == sys.executable and args[1] in ("-m", "-c")
                                        and (args[1] == "-c" or args[2].startswith("shardstream")))
    cwd = os.path.abspath(options.get("cwd") or os.getcwd())
    return (command and not set(options) - _TAKEN
            and _warm_server().serves(environ, cwd, os.path.dirname(SCRIPT) if args[0] == SCRIPT else cwd))


def popen(args, **options) -> subprocess.Popen | WarmProcess:
    """subprocess.Popen(args, **options), forked from the warm server where that is the same thing."""
    args = [str(a) for a in args]
    environ = _environment(options.get("env"))
    if not _warm(args, options, environ):
        return subprocess.Popen(args, **options)
    return WarmProcess(args, environ, **options)


def run(args, *, input=None, capture_output: bool = False, timeout: float | None = None, check: bool = False,
        **options) -> subprocess.CompletedProcess:
    """subprocess.run(args, ...), forked from the warm server where that is the same thing."""
    args = [str(a) for a in args]
    environ = _environment(options.get("env"))
    if not _warm(args, options, environ):
        return subprocess.run(args, input=input, capture_output=capture_output, timeout=timeout, check=check,
                              **options)
    if capture_output:
        options["stdout"] = options["stderr"] = subprocess.PIPE
    if input is not None:
        options["stdin"] = subprocess.PIPE
    with WarmProcess(args, environ, **options) as process:
        try:
            out, err = process.communicate(input, timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    done = subprocess.CompletedProcess(args, process.returncode, out, err)
    if check:
        done.check_returncode()
    return done


class WarmProcess:
    """What the tests use of subprocess.Popen, for a command forked from the warm server: pid, pipes, poll,
    wait, signals, communicate."""

    def __init__(self, args: list[str], environ: dict[str, str], *, stdin=None, stdout=None, stderr=None,
                 text: bool = False, cwd=None, env=None, start_new_session: bool = False) -> None:
        self.args, self.returncode = args, None
        self.stdin = self.stdout = self.stderr = None
        encoding = locale.getpreferredencoding(False) if text else None
        null = os.open(os.devnull, os.O_RDWR)
        given: list[int] = []   # this process's ends of the pipes: closed once the child has its own

        def end(option, inherited: int, reading: bool) -> tuple[int, object]:
            if option is subprocess.PIPE:
                theirs, ours = os.pipe() if reading else reversed(os.pipe())
                given.append(theirs)
                mode = ("w" if reading else "r") + ("" if text else "b")
                return theirs, open(ours, mode, encoding=encoding)
            if option is subprocess.DEVNULL:
                return null, None
            if option is None:
                return inherited, None
            return (option if isinstance(option, int) else option.fileno()), None

        child_in, self.stdin = end(stdin, null, True)   # not the test process's own stdin
        child_out, self.stdout = end(stdout, 1, False)
        child_err, self.stderr = (child_out, None) if stderr is subprocess.STDOUT else end(stderr, 2, False)
        request = json.dumps({"args": args if args[0] == SCRIPT else args[1:], "cwd": str(cwd or os.getcwd()),
                              "env": environ, "new_session": start_new_session}).encode()
        self._conn = socket.socket(socket.AF_UNIX)
        self._conn.connect(_warm_server().path)
        socket.send_fds(self._conn, [_HEADER.pack(len(request))], [child_in, child_out, child_err])
        self._conn.sendall(request)
        for fd in (*given, null):
            os.close(fd)
        self._answers = b""
        self.pid = int(self._answer(None))

    def _answer(self, timeout: float | None) -> str | None:
        """The server's next line, or None if none came within `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._answers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            self._answers += self._conn.recv(64)
        line, self._answers = self._answers.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        return self._status(0)

    def wait(self, timeout: float | None = None) -> int:
        if self._status(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            line = self._answer(timeout)
            if line is not None:
                self.returncode = int(line)
                self._conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input=None, timeout: float | None = None) -> tuple:
        read: dict[str, object] = {}

        def drain(name: str, stream) -> None:
            read[name] = stream.read()
            stream.close()

        readers = [threading.Thread(target=drain, args=(name, stream), daemon=True)
                   for name, stream in (("out", self.stdout), ("err", self.stderr)) if stream is not None]
        for reader in readers:
            reader.start()
        if self.stdin is not None:
            try:
                if input:
                    self.stdin.write(input)
                self.stdin.close()
            except BrokenPipeError:
                pass
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if any(reader.is_alive() for reader in readers):
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return read.get("out"), read.get("err")

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc) -> None:
        for stream in (self.stdout, self.stderr, self.stdin):
            if stream is not None:
                stream.close()
        self.wait()


# ---- the server side: python warm_python.py SOCKET ----

def _serve(path: str) -> None:
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)   # gone with the test process that started it
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")   # as shardstream.cli.main sets it before torch allocates
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)   # the waiters below are reaped by the kernel
    print("ready", json.dumps(sys.path), flush=True)
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                _wait_for_command(conn)
            finally:
                os._exit(0)   # never back into this loop, whatever happened
        conn.close()


def _wait_for_command(conn: socket.socket) -> None:
    """Fork the command's process, tell the client its pid, then its exit status."""
    header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    size, = _HEADER.unpack(header)
    request = b""
    while len(request) < size:
        request += conn.recv(size - len(request))
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run_command(json.loads(request), fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())


def _run_command(request: dict, fds: list[int]) -> None:
    own = {os.path.abspath(folder) for folder in _folders(os.environ)}   # the server's PYTHONPATH, from its folder
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request["new_session"]:
        os.setsid()
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = sys.__stdout__ = _output(1, line_buffering=os.isatty(1))
    sys.stderr = sys.__stderr__ = _output(2, errors="backslashreplace", line_buffering=True)
    how = request["args"][0]
    first = {"-c": "", "-m": os.getcwd()}.get(how, os.path.dirname(how))
    given = [os.path.abspath(folder) for folder in _folders(os.environ)]   # after chdir: relative to the command's
    left_out = {*given, *own}
    sys.path[:] = [first, *given, *(folder for folder in sys.path[1:] if os.path.abspath(folder) not in left_out)]
    code = 0
    try:
        if how == "-m":
            sys.argv = request["args"][1:]
            runpy.run_module(request["args"][1], run_name="__main__", alter_sys=True)
        elif how == SCRIPT:
            sys.argv = request["args"]
            runpy.run_path(how, run_name="__main__")
        else:
            sys.argv = ["-c", *request["args"][2:]]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(request["args"][1], "<string>", "exec"), main.__dict__)
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    _finish(code)


def _output(fd: int, **options) -> io.TextIOWrapper:
    """A standard output stream as the interpreter makes it: unbuffered bytes under PYTHONUNBUFFERED."""
    raw = io.FileIO(fd, "w", closefd=False)
    if os.environ.get("PYTHONUNBUFFERED"):
        return io.TextIOWrapper(raw, write_through=True, **options)
    return io.TextIOWrapper(io.BufferedWriter(raw), **options)


def _exit_code(value) -> int:
    if value is None or isinstance(value, int):
        return value or 0
    print(value, file=sys.stderr)
    return 1


def _finish(code: int) -> None:
    """What an interpreter does as it exits: wait for its threads, run atexit, flush; then the exit status."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    _serve(sys.argv[1])
