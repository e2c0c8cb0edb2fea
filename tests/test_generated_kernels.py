"""The checked-in CUDA instantiation files are what scripts/generate_kernels.py writes (CPU-only: nothing
is compiled)."""
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_instantiation_files_are_current():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "generate_kernels.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
