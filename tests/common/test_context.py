"""The context size every process agrees on (common/models.context_size)."""
from __future__ import annotations

import logging
from collections import namedtuple

import psutil
import pytest

from common import models
from common.config import Settings
from common.models import context_size, resolve


@pytest.fixture()
def gemma():
    try:
        return resolve("gemma3-270m", Settings().models_path())
    except models.ModelError as e:
        pytest.fail(str(e))


def test_default_is_the_trained_context_when_it_fits(model_path, gemma):
    assert context_size(model_path, 0) == 8192       # SmolLM2
    assert context_size(gemma, 0) == 32768            # 36 KiB of f32 K/V per token: 1.1 GiB


def test_default_is_capped_by_memory(gemma, monkeypatch, caplog):
    Mem = namedtuple("Mem", "total")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Mem(1 << 30))
    with caplog.at_level(logging.INFO, logger="ricordo"):
        ctx = context_size(gemma, 0)
    # a quarter of 1 GiB / (2 * 4 bytes * 18 layers * 1 head * 256) = 7281 -> multiple of 256
    assert ctx == 7168 and "would take" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ricordo"):
        assert context_size(gemma, 0, warn=False) == 7168
    assert not caplog.text


def test_requested_wins_and_above_the_trained_context_warns_once(model_path, caplog):
    models._warned.clear()
    with caplog.at_level(logging.WARNING, logger="ricordo"):
        assert context_size(model_path, 4096) == 4096
        assert not caplog.text
        assert context_size(model_path, 12288, warn=False) == 12288
        assert not caplog.text
        assert context_size(model_path, 12288) == 12288
        assert context_size(model_path, 16384) == 16384
    assert caplog.text.count("above the model's trained context 8192") == 1
