"""README.md's API tour runs as the README says: ``mpiexec -n 2 python tour.py`` on a CPU."""

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tour_source():
    """The Python block under README's "API tour" heading."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text[text.index("## API tour"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the API tour holds one python block"
    return blocks[0]


def test_api_tour_runs_at_two_ranks(tmp_path):
    pytest.importorskip("torch")
    if shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not installed")
    script = tmp_path / "tour.py"
    script.write_text(tour_source())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(script)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = sorted(re.findall(r"rank (\d): \((\d+), 128\) torch.bfloat16, x.grad \((\d+), 256\)",
                              out.stdout))
    assert [rank for rank, _, _ in lines] == ["0", "1"], out.stdout
    for _, rows, grad_rows in lines:  # the combine returns each rank's own rows
        assert rows == grad_rows
