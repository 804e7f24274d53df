"""Shared fixtures: the default model (loaded once per compute dtype), its text side, and
llama.cpp's reference vectors (tests/data; see its README for how they were made).

Loading is lazy: a test module that uses none of these fixtures never imports torch.
"""
from __future__ import annotations

import functools
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:          # `pytest` without `python -m` and without `pip install -e`
    sys.path.insert(0, ROOT)

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
VECTORS = os.path.join(DATA, "smollm2-135m-q4_1.json")
MAX_CONTEXT = 8192


def pytest_report_header(config):
    """Which compute dtype the servers of this run use: the suite must pass in both."""
    from procs.inference.runtime import describe
    return describe()


def default_model_path() -> str:
    from common.config import Settings
    from common.models import DEFAULT_FILE
    return os.environ.get("RICORDO_TEST_MODEL") or os.path.join(Settings().models_path(), DEFAULT_FILE)


@pytest.fixture(scope="session")
def model_path() -> str:
    path = default_model_path()
    if not os.path.isfile(path):
        pytest.skip(f"default model not found at {path} (run `ricordo fetch-model`)")
    return path


@pytest.fixture(scope="session")
def vectors() -> dict:
    with open(VECTORS) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def text_model(model_path):
    from common.models import load_text
    return load_text(model_path)


@functools.lru_cache(maxsize=None)
def _load_model(path: str, dtype_name: str, packed: bool = True):
    from procs.inference.loader import load
    from procs.inference.model import Llama
    from procs.inference.runtime import DTYPES, PREFILL_F32, native_prefill
    from procs.inference import native
    from common.config import Settings
    # the kernels the server runs (native.load builds them once and caches the build), and
    # its choice of prefill attention and of prefill's products for this CPU and dtype
    math = os.environ.get("RICORDO_PREFILL_MATH", "auto")
    return Llama(load(path, DTYPES[dtype_name], "cpu"), MAX_CONTEXT, packed=packed, kernels=native.load(),
                 native_prefill=native_prefill(Settings(), DTYPES[dtype_name]),
                 prefill_f32=PREFILL_F32[math])


def dense_twin(model):
    """The same model and dtype, decode on the dense weights (the prefill's kernels)."""
    return _load_model(default_model_path(), torch_name(model.dtype), False)


def torch_name(dtype) -> str:
    return str(dtype).replace("torch.", "").replace("float32", "f32").replace("bfloat16", "bf16")


@pytest.fixture(scope="session")
def model_f32(model_path):
    return _load_model(model_path, "f32")


@pytest.fixture(scope="session")
def model_bf16(model_path):
    return _load_model(model_path, "bf16")


@pytest.fixture(scope="session", params=["f32", "bf16"])
def model(request, model_path):
    """The model in each compute dtype (tests using it run once per dtype)."""
    return _load_model(model_path, request.param)
