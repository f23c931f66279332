"""tests/run.sh, README's test command, with its stages' commands replaced by a stand-in
``timeout`` (every stage runs under it): the closing summary and the exit status."""

import os
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
STAGES = ["serial suite", "MPI suite, 2 ranks", "MPI suite, 3 ranks", "emulated nodes, 4 ranks",
          "fault injection, 2 ranks", "fault injection, 3 ranks", "soak, 2 ranks", "soak, 3 ranks",
          "main job on the CPU"]


def run_script(tmp_path, exit_codes):
    """Run tests/run.sh with a ``timeout`` on PATH that runs nothing: it exits with the first
    ``exit_codes`` value whose key is in its command line (0 if none)."""
    if shutil.which("bash") is None:
        pytest.skip("bash not installed")
    cases = "".join(f'    *"{key}"*) exit {code} ;;\n' for key, code in exit_codes.items())
    fake = tmp_path / "timeout"
    fake.write_text(f'#!/bin/sh\necho "ran: $*"\ncase "$*" in\n{cases}esac\nexit 0\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(["bash", os.path.join(HERE, "run.sh")], capture_output=True, text=True,
                          env=env, timeout=60)


def summary(out):
    """The summary's stage lines, as (name, verdict, exit status), and its closing line."""
    lines = out.stdout.splitlines()
    start = lines.index("=== summary (stage, verdict, exit status, seconds)") + 1
    stages = []
    for line in lines[start:-1]:
        name, rest = line[:26].rstrip(), line[26:].split()
        assert rest[0] in ("passed", "FAILED") and rest[1] == "exit" and rest[-1] == "s", line
        stages.append((name, rest[0], int(rest[2])))
    return stages, lines[-1]


def test_every_stage_passing_ends_in_a_passing_verdict(tmp_path):
    out = run_script(tmp_path, {"-m faults": 5})  # pytest's 5: no tests collected, a pass
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("ran: ") == len(STAGES)
    stages, last = summary(out)
    assert stages == [(name, "passed", 5 if name.startswith("fault") else 0) for name in STAGES]
    assert last == f"{len(STAGES)} passed, 0 failed"


def test_a_failed_stage_is_named_and_fails_the_run(tmp_path):
    out = run_script(tmp_path, {"-n 3": 1, "bench/soak.py --calls 200": 124})
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.count("ran: ") == len(STAGES)  # the later stages still ran
    stages, last = summary(out)
    want = {"MPI suite, 3 ranks": 1, "soak, 3 ranks": 1, "soak, 2 ranks": 124}
    assert stages == [(name, "FAILED" if name in want else "passed", want.get(name, 0))
                      for name in STAGES]
    assert last == f"{len(STAGES) - 3} passed, 3 failed"
