"""Issue 44 item 9: files read from disk cannot reach outside what they describe: a checkpoint index names shards
inside its directory only, and a training state resumes from tensors and plain data only (no pickled code)."""

import json

import pytest
import torch

from k3serve.model.checkpoint import CheckpointError, CheckpointReader, INDEX_FILE
from k3serve.train.loop import TrainError, load_train_state


@pytest.mark.parametrize("fname", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors",
                                   "..\\x.safetensors", "C:\\x.safetensors", ""])
def test_an_index_naming_a_shard_outside_the_checkpoint_is_refused(tmp_path, fname):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / INDEX_FILE).write_text(json.dumps({"weight_map": {"w": fname}}))
    with pytest.raises(CheckpointError, match=r"weight_map\['w'\]"):
        CheckpointReader(ckpt)


def test_an_index_with_shards_inside_is_read(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "m-1.safetensors", "b": "sub/m-2.safetensors"}}))
    assert CheckpointReader(ckpt).names() == ["a", "b"]


class Gadget:
    """Stands for any pickled object: unpickling it would import and call whatever its reduce names."""

    def __reduce__(self):
        return (print, ("code ran on resume",))


def test_a_training_state_with_pickled_objects_is_refused(tmp_path, capsys):
    good = {"optimizer": {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": []}, "step": 3,
            "train_s": 1.5, "tokens": 10, "history": [{"step": 3, "train_bpb": None}]}
    torch.save(good, tmp_path / "good.pt")
    assert load_train_state(tmp_path / "good.pt")["step"] == 3
    torch.save({**good, "history": [Gadget()]}, tmp_path / "bad.pt")
    with pytest.raises(TrainError, match="refusing to resume"):
        load_train_state(tmp_path / "bad.pt")
    assert "code ran" not in capsys.readouterr().out
