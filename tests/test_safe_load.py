"""Reading a ``torch.save`` file (:mod:`mmoe.safe_load`): what torch warns about while it reads one stays off the
console only where the caller has nothing to act on."""

from __future__ import annotations

import warnings

import pytest
import torch

from mmoe.safe_load import load_checkpoint_file


def test_a_file_of_another_pickle_protocol_is_read_or_refused_without_torchs_warning(tmp_path):
    readable, unreadable = tmp_path / "protocol3.pt", tmp_path / "protocol4.pt"
    torch.save({"w": torch.arange(3.0)}, readable, pickle_protocol=3)
    torch.save({"w": torch.arange(3.0)}, unreadable, pickle_protocol=4)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        torch.load(readable, weights_only=True)  # torch's warning, as it is without the filter
        given = len(shown)
        assert torch.equal(load_checkpoint_file(readable)["w"], torch.arange(3.0))
        with pytest.raises(ValueError, match=r"protocol4\.pt could not be read"):
            load_checkpoint_file(unreadable)
    assert given == 1 and "Detected pickle protocol 3" in str(shown[0].message)
    assert len(shown) == given  # none from the loads of mmoe.safe_load


def test_any_other_warning_while_torch_reads_the_file_still_reaches_the_caller(tmp_path, monkeypatch):
    path = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(1)}, path)
    real_load = torch.load

    def load(*args, **kwargs):
        warnings.warn("a warning torch may give one day", UserWarning, stacklevel=1)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    with pytest.warns(UserWarning, match="a warning torch may give one day"):
        load_checkpoint_file(path)
