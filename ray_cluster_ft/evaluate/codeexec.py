"""Run untrusted generated programs and their tests in a separate, resource-limited process.

Model-written code is never executed in the calling (trainer or evaluator) process. Each program runs as
``python -I`` in a fresh temporary working directory, in its own session (so a timeout kills every process
it started), with a wall-clock time limit, stdin closed, a minimal environment and ``setrlimit`` caps on
address space, CPU seconds, file size and core dumps.

The caps are set by a tiny bootstrap in the child (``python -I -c BOOTSTRAP ...``) that calls
``resource.setrlimit`` and then ``os.execv``\\ s the interpreter on the program: the limits survive ``exec``.
This is used instead of ``subprocess``'s ``preexec_fn``, which CPython documents as unsafe when the parent has
threads (the evaluator runs beside torch's thread pools and checks problems from a thread pool).

What this is not: a security boundary against a hostile program. There is no network, filesystem or
user-namespace isolation (that needs root or containers); the programs run are the model's completions to
the held-out problems and the tests shipped with the data. Same threat model as the HumanEval harness
(Chen et al. 2021, "Evaluating Large Language Models Trained on Code", section 2.3), minus its sandbox.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["run_program", "extract_code", "build_program", "check_completions"]

# argv: address-space bytes, CPU seconds, file-size bytes, program path. Runs with -I (isolated: no user site,
# no PYTHON* variables); -B keeps the sandbox free of .pyc files.
_BOOTSTRAP = (
    "import os,resource,sys\n"
    "a,c,f=(int(x) for x in sys.argv[1:4])\n"
    "resource.setrlimit(resource.RLIMIT_CORE,(0,0))\n"
    "resource.setrlimit(resource.RLIMIT_AS,(a,a))\n"
    "resource.setrlimit(resource.RLIMIT_CPU,(c,c))\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE,(f,f))\n"
    "os.execv(sys.executable,[sys.executable,'-I','-B',sys.argv[4]])\n"
)


def run_program(program: str, time_limit_s: float = 5.0, memory_mb: int = 1024, max_file_mb: int = 16,
                tail_chars: int = 2000) -> dict:
    """Run one Python program in a separate, resource-limited process and report how it ended.

    Args:
        program: Python source (completion + tests); written to ``prog.py`` in a fresh temporary directory,
            which is also the working directory and ``HOME``, and is deleted afterwards.
        time_limit_s: wall-clock limit in seconds (> 0), interpreter start included; on expiry the whole
            process group is killed with SIGKILL. The CPU-time limit is ``ceil(time_limit_s) + 1`` s.
        memory_mb: address-space limit (``RLIMIT_AS``) in MiB.
        max_file_mb: largest file the program may write (``RLIMIT_FSIZE``), which also bounds its captured
            output.
        tail_chars: characters of stderr kept in the result.

    Returns:
        ``{"status": "passed" | "failed" | "timeout" | "syntax_error", "returncode": int | None,
        "seconds": float (wall), "stderr": str (tail)}``. ``passed`` means exit status 0; ``timeout`` means
        killed at the wall-clock limit or by the CPU limit (SIGXCPU/SIGKILL); ``syntax_error`` means the
        program did not compile; any other exit is ``failed``.

    Raises:
        ValueError: ``time_limit_s <= 0``, ``memory_mb < 64`` or ``max_file_mb < 1``.
    """
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0, got {time_limit_s!r}")
    if memory_mb < 64:
        raise ValueError(f"memory_mb must be >= 64 (the interpreter needs it to start), got {memory_mb!r}")
    if max_file_mb < 1:
        raise ValueError(f"max_file_mb must be >= 1, got {max_file_mb!r}")
    with tempfile.TemporaryDirectory(prefix="rcft-exec-") as tmp:
        prog = Path(tmp) / "prog.py"
        prog.write_text(program, encoding="utf-8", errors="surrogateescape")
        out_path, err_path = Path(tmp) / "stdout.txt", Path(tmp) / "stderr.txt"
        cmd = [sys.executable, "-I", "-c", _BOOTSTRAP, str(memory_mb << 20), str(int(time_limit_s) + 2),
               str(max_file_mb << 20), str(prog)]
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
               "OMP_NUM_THREADS": "1"}
        t0 = time.perf_counter()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, close_fds=True)
            timed_out = False
            try:
                rc = proc.wait(timeout=time_limit_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                rc = proc.wait()
            # Children the program forked may outlive it: its session is killed either way.
            _kill_group(proc.pid)
        seconds = time.perf_counter() - t0
        stderr = err_path.read_bytes()[-4 * tail_chars:].decode("utf-8", errors="replace")[-tail_chars:]
    if timed_out or rc in (-signal.SIGXCPU, -signal.SIGKILL):
        status = "timeout"
    elif rc == 0:
        status = "passed"
    elif re.search(r"^(SyntaxError|IndentationError|TabError)\b", stderr, flags=re.M) and "Traceback" not in stderr:
        status = "syntax_error"  # a compile error of prog.py itself has no traceback above it
    else:
        status = "failed"
    return {"status": status, "returncode": rc, "seconds": round(seconds, 4), "stderr": stderr}


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_FENCE = re.compile(r"```[ \t]*(?:[A-Za-z0-9_+-]+)?[ \t]*\n(.*?)(?:```|\Z)", re.S)
# Top-level usage examples after the solution: cut there, like the stop sequences of Chen et al. 2021 (section
# 3.3: "\nclass", "\ndef", "\n#", "\nif", "\nprint"), narrowed so that a reply defining the whole function
# (and helpers) keeps its definitions. A usage example cut by the token limit would otherwise be a syntax error.
_STOP = re.compile(r"^(?:print\(|assert\b|if __name__\b)", re.M)


def extract_code(text: str) -> str:
    """The code in a model's reply.

    The first fenced block (```` ```python ... ``` ````; an unclosed fence runs to the end) if there is one,
    else the whole reply (leading indentation kept: a function-body completion starts indented); then cut at
    the first top-level ``print(``, ``assert`` or ``if __name__`` line (usage examples, not the solution).
    """
    m = _FENCE.search(text)
    code = m.group(1) if m else text
    stop = _STOP.search(code)
    return code[: stop.start()] if stop else code


def build_program(completion: str, prefix: str = "", tests: str = "") -> str:
    """``prefix`` + the completion's code + ``tests``, as one program.

    Args:
        completion: the model's reply (see :func:`extract_code`).
        prefix: code the completion continues (HumanEval: the signature and docstring). A completion that
            re-defines the whole function at top level still works: the prefix's function then has a
            docstring-only body and the completion's definition replaces it.
        tests: test code run after the solution (asserts; HumanEval: ``check(entry_point)``).
    """
    code = extract_code(completion)
    if prefix and not prefix.endswith("\n") and not code.startswith("\n"):
        prefix += "\n"
    return f"{prefix}{code}\n\n{tests}\n"


def check_completions(completions: list[str], problems: list[dict], time_limit_s: float = 5.0,
                      memory_mb: int = 1024, workers: int = 2) -> list[dict]:
    """Run each completion with its problem's tests (:func:`run_program`), ``workers`` processes at a time.

    Args:
        completions: one model reply per problem.
        problems: dicts with ``tests`` (str, required) and optional ``prefix`` (str).
        time_limit_s, memory_mb: per-program limits (:func:`run_program`).
        workers: programs run concurrently (>= 1).

    Returns:
        One :func:`run_program` result per problem, in order.

    Raises:
        ValueError: ``len(completions) != len(problems)``, or a problem without a ``tests`` string.
    """
    if len(completions) != len(problems):
        raise ValueError(f"{len(completions)} completions for {len(problems)} problems")
    for i, p in enumerate(problems):
        if not isinstance(p.get("tests"), str) or not p["tests"].strip():
            raise ValueError(f"problem {i} has no 'tests' string")
    programs = [build_program(c, p.get("prefix", ""), p["tests"]) for c, p in zip(completions, problems)]
    if not programs:
        return []
    with ThreadPoolExecutor(max_workers=max(1, int(workers))) as pool:
        return list(pool.map(lambda prog: run_program(prog, time_limit_s, memory_mb), programs))
