"""tests/warm_python.py: a command forked from the warm interpreter behaves as the same command run afresh."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import warm_python

CLI = [sys.executable, "-m", "shardstream.cli"]
PRELOADED = "import sys; print('torch' in sys.modules)"


@pytest.mark.parametrize("command", [CLI, [warm_python.SCRIPT]], ids=["module", "script"])
def test_a_command_gives_what_a_fresh_process_gives(command, tmp_path):
    for args in (["verify", "missing-store"], ["convert", "-h"], ["generate", "x", "--max-new-tokens", "0"]):
        warm = warm_python.popen([*command, *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        assert isinstance(warm, warm_python.WarmProcess)
        out, err = warm.communicate(timeout=120)
        fresh = subprocess.run([*command, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert (warm.returncode, out, err) == (fresh.returncode, fresh.stdout, fresh.stderr)
        assert warm.returncode != 0 or args[-1] == "-h"


def test_streams_status_folder_arguments_and_switches(tmp_path):
    code = ("import os, sys; print(sys.stdin.read().upper(), os.getcwd(), sys.argv[1:], "
            "os.environ['SHARDSTREAM_CACHE']); print('to stderr', file=sys.stderr); sys.exit(3)")
    done = warm_python.run([sys.executable, "-c", code, "a", "b"], input="given", cwd=tmp_path, capture_output=True,
                           text=True, env={**os.environ, "SHARDSTREAM_CACHE": "elsewhere"})
    assert done.returncode == 3
    assert done.stdout == f"GIVEN {tmp_path} ['a', 'b'] elsewhere\n" and done.stderr == "to stderr\n"
    both = [sys.executable, "-c", "import sys; print(1); print(2, file=sys.stderr)"]
    merged = warm_python.run(both, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    fresh = subprocess.run(both, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert merged.stdout == fresh.stdout and sorted(merged.stdout.split()) == ["1", "2"] and merged.stderr is None
    with pytest.raises(subprocess.CalledProcessError):
        warm_python.run([sys.executable, "-c", "raise SystemExit('no')"], capture_output=True, check=True)


def test_an_exit_waits_for_threads_and_runs_atexit():
    code = ("import atexit, threading, time; atexit.register(print, 'atexit'); "
            "threading.Thread(target=lambda: (time.sleep(0.5), print('thread'))).start()")
    assert warm_python.run([sys.executable, "-c", code], capture_output=True, text=True).stdout == "thread\natexit\n"


def test_only_an_environment_read_after_the_imports_is_served_warm(tmp_path):
    warm = warm_python.run([sys.executable, "-c", PRELOADED], capture_output=True, text=True)
    fresh = warm_python.run([sys.executable, "-c", PRELOADED], capture_output=True, text=True,
                            env={**os.environ, "HF_HOME": str(tmp_path)})
    assert (warm.stdout, fresh.stdout) == ("True\n", "False\n")


def test_a_pythonpath_of_folders_on_the_warm_path_is_served_warm_with_them_first(tmp_path):
    """Also its empty entry (the working folder, already first for `-c`); a folder of its own runs afresh."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(warm_python.__file__))), "src")
    (tmp_path / "own").mkdir()
    code = "import json, sys; print(json.dumps(['torch' in sys.modules, sys.path]))"
    for folder, preloaded in ((src, True), (os.path.relpath(src, tmp_path), True), ("own", False)):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([folder, os.environ.get("PYTHONPATH", "")])}
        warm = warm_python.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
        fresh = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
        (warm_preloaded, warm_path), (_, fresh_path) = json.loads(warm.stdout), json.loads(fresh.stdout)
        assert warm_preloaded == preloaded, folder
        warm_path, fresh_path = ([os.path.abspath(os.path.join(tmp_path, f)) for f in path]
                                 for path in (warm_path, fresh_path))
        assert warm_path == fresh_path and warm_path[:2] == [str(tmp_path), os.path.abspath(tmp_path / folder)]


def test_a_timeout_kills_it_and_signals_reach_it():
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        process = warm_python.popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                                    stdout=subprocess.PIPE, text=True)
        assert isinstance(process, warm_python.WarmProcess)
        assert process.stdout.readline() == "up\n" and process.poll() is None
        process.send_signal(sig)
        assert process.wait(timeout=30) == -sig
        with pytest.raises(ProcessLookupError):
            os.kill(process.pid, 0)
        process.stdout.close()
