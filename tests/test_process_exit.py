"""mmoe.process_exit: the objects alive at exit are frozen, so the interpreter's shutdown skips them; what a process
wrote, printed or registered to run at exit is still done."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: A process (folder, "freeze" or "plain") whose only reference-cycle object says when it is collected.
CYCLE = """
import gc, sys, tempfile
from pathlib import Path
from mmoe.process_exit import freeze_at_exit

class Cycle:
    def __del__(self):
        sys.stderr.write("collected\\n")

cycle = Cycle()
cycle.itself = cycle
del cycle
gc.disable()  # the cycle waits for the shutdown's collection
kept = tempfile.TemporaryDirectory(dir=sys.argv[1])
kept.itself = kept  # a temporary directory in a cycle: removed at exit by its weakref.finalize all the same
Path(kept.name, "inside").write_text("x")
with open(Path(sys.argv[1]) / "written.txt", "w") as handle:
    handle.write("whole")
registered = sys.argv[2] == "freeze" and freeze_at_exit() and freeze_at_exit()
print(kept.name, registered, end="")  # not flushed by hand
"""


def run_cycle(folder: Path, mode: str, **environment: str) -> tuple[str, bool, str]:
    """(temporary directory the process made, whether it registered the freeze, its stderr)."""
    folder.mkdir()
    done = subprocess.run([sys.executable, "-c", CYCLE, str(folder), mode], capture_output=True, text=True,
                          env=os.environ | environment, timeout=120, check=True)  # fmt: skip
    assert (folder / "written.txt").read_text() == "whole"
    temporary, registered = done.stdout.split()
    assert Path(temporary).parent == folder and not Path(temporary).exists()  # its exit handler ran
    return temporary, registered == "True", done.stderr


def test_a_frozen_process_skips_the_shutdown_collection_and_still_runs_its_exit_handlers(tmp_path):
    assert run_cycle(tmp_path / "plain", "plain")[1:] == (False, "collected\n")  # the collection freezing saves
    assert run_cycle(tmp_path / "frozen", "freeze")[1:] == (True, "")
    # MMOE_FREEZE_AT_EXIT=0: the interpreter's own shutdown
    assert run_cycle(tmp_path / "off", "freeze", MMOE_FREEZE_AT_EXIT="0")[1:] == (False, "collected\n")


def test_the_mmoe_command_freezes_at_exit(tmp_path):
    """An exit handler registered before ``mmoe.cli.main`` runs after the one main registers: it sees the freeze."""
    script = (
        "import atexit, gc, sys\n"
        "atexit.register(lambda: sys.stderr.write(f'frozen {gc.get_freeze_count()}\\n'))\n"
        "from mmoe.cli import main\n"
        "sys.exit(main(['eval', '--help']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    frozen = [line for line in done.stderr.splitlines() if line.startswith("frozen ")]
    assert len(frozen) == 1 and int(frozen[0].split()[1]) > 1000, done.stderr
