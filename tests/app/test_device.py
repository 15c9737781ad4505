"""The app's device: CUDA when torch sees a GPU, $WORKBENCH_DEVICE to choose, and the sidebar
says where the model runs and in which dtype."""

import torch

from ui import common


def test_device_follows_the_environment_and_the_gpu(monkeypatch):
    monkeypatch.delenv("WORKBENCH_DEVICE", raising=False)
    assert common.app_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("WORKBENCH_DEVICE", "cpu")
    assert common.app_device() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("WORKBENCH_DEVICE")
    assert common.app_device() == "cuda"


def test_the_sidebar_names_the_device_and_dtype(app, monkeypatch):
    monkeypatch.setenv("WORKBENCH_DEVICE", "cpu")
    at = app("Inspect")
    captions = [c.value for c in at.sidebar.caption]
    assert any("Runs on `cpu` in `float32`" in c for c in captions), captions
