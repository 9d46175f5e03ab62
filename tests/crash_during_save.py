"""Runs a training script (the arguments after this file's name) with rank 1 killed in the middle of a
torch.distributed.checkpoint save: with COAT_TEST_CRASH_SAVE=N, rank 1 exits right after writing its part of
the checkpoint of step N, before the checkpoint is complete. tests/test_examples.py runs it under torchrun."""
import os
import re
import runpy
import sys

from torch.distributed.checkpoint import filesystem

CRASH_STEP = int(os.environ["COAT_TEST_CRASH_SAVE"])
write_data = filesystem.FileSystemWriter.write_data


def write_data_then_exit(self, plan, planner):
    written = write_data(self, plan, planner)
    if os.environ["RANK"] == "1" and re.fullmatch(rf"step_{CRASH_STEP}(\..*)?", os.path.basename(str(self.path))):
        written.wait()
        os._exit(3)
    return written


filesystem.FileSystemWriter.write_data = write_data_then_exit
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
