"""train.py under torchrun, with a NaN written into the last rank's gradient of one voted tensor
(model.layers.0.mlp.down_proj.weight) in backward number NAN_BACKWARD (tests/test_comm.py)."""
import os
import runpy
import sys

from train_utils import startup

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
real_build_model = startup.build_model


def build_model(run):
    out = real_build_model(run)
    if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
        calls = [0]

        def poison(grad):
            calls[0] += 1
            return grad * float("nan") if calls[0] == int(os.environ["NAN_BACKWARD"]) else grad

        out[0].model.layers[0].mlp.down_proj.weight.register_hook(poison)
    return out


startup.build_model = build_model
sys.argv[0] = os.path.join(REPO, "train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
