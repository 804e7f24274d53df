"""`ricordo generate` as a user runs it: real processes, all started at once (module fixture)
so that their interpreter and torch start-up overlap."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from procs.cli import main
from tests.helpers import ROOT

# name -> (extra argv, text expected in the error line); --model is the default model unless
# given. BAD run as processes; BAD_IN_PROCESS through procs.cli.main (no interpreter + torch
# start-up each, ~2 s of CPU on a slow core; an exception escaping main fails the test just
# as a traceback would).
BAD = {
    "max-tokens": (["--max-tokens", "-1"], "max_tokens"),
    "top-p": (["--top-p", "1.5"], "top_p"),
    "dtype": (["--dtype", "f8"], "--dtype"),
    "missing-model": (["--model", "/nonexistent"], "not found"),
    "junk-model": (["--model", "{junk}"], "not a GGUF file"),
    "empty-model": (["--model", "{empty}"], "not a GGUF file"),
}
BAD_IN_PROCESS = {
    "empty-prompt": (["--prompt", "", "--ctx-size", "64"], "prompt is empty"),
    "chunk-size": (["--chunk-size", "0"], "chunk-size"),
    "device": (["--device", "nosuchdevice"], "device"),
    "seed": (["--seed", str(2**64)], "seed"),
    "temperature": (["--temperature", "-1"], "temperature"),
}
OK = {"hi": ["--prompt", "hi", "--max-tokens", "5"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_path):
    tmp = tmp_path_factory.mktemp("cli")
    junk, empty = tmp / "junk.gguf", tmp / "empty.gguf"
    junk.write_bytes(bytes(range(256)) * 64)
    empty.write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RICORDO_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    procs = {}
    for name, argv in [(n, a) for n, (a, _) in BAD.items()] + list(OK.items()):
        argv = [x.format(junk=junk, empty=empty) for x in argv]
        base = ["--prompt", "hi"] if "--prompt" not in argv else []
        if "--model" not in argv:
            base += ["--model", model_path]
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "procs.cli", "generate", *base, *argv], cwd=ROOT, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for name, p in procs.items():
        try:
            so, se = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
        out[name] = (p.returncode, so, se)
    return out


def test_generate(runs):
    rc, out, err = runs["hi"]
    assert rc == 0, err
    assert out.strip(), "no text generated"
    assert "tok/s" in err
    assert "Traceback" not in err


def _check_error(rc, out, err, expected, argparse_error=False):
    assert rc != 0
    assert "Traceback" not in err, err
    assert out == ""
    lines = err.strip().splitlines()
    errors = [ln for ln in lines if "error:" in ln]
    assert len(errors) == 1 and errors[0] == lines[-1], err
    if not argparse_error:                   # argparse prints its usage above the error line
        assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expected in errors[0]


@pytest.mark.parametrize("name", list(BAD))
def test_bad_arguments_give_one_error_line(runs, name):
    _check_error(*runs[name], BAD[name][1], argparse_error=name == "dtype")


@pytest.mark.parametrize("name", list(BAD_IN_PROCESS))
def test_bad_arguments_in_process(capsys, monkeypatch, model_path, name):
    for k in [k for k in os.environ if k.startswith("RICORDO_")]:
        monkeypatch.delenv(k)
    argv, expected = BAD_IN_PROCESS[name]
    if "--prompt" not in argv:
        argv = ["--prompt", "hi", *argv]
    try:
        rc = main(["generate", "--model", model_path, *argv])
    except SystemExit as e:                  # argparse
        rc = e.code
    cap = capsys.readouterr()
    _check_error(rc, cap.out, cap.err, expected)


def test_unknown_command(capsys):
    assert main([]) == 2
    assert main(["nope"]) == 2
    assert "usage:" in capsys.readouterr().err


def test_readme_options_table_is_the_settings(capsys):
    """README's option table is `ricordo config --markdown`: a setting added, renamed or given
    another default without the README fails here."""
    assert main(["config", "--markdown"]) == 0
    table = capsys.readouterr().out
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    block = readme.split("<!-- options: begin -->\n", 1)[1].split("<!-- options: end -->", 1)[0]
    assert block == table
    assert "`RICORDO_KV_DISK_DIR`" in table and "(or `RICORDO_MODELS`)" in table


def test_models_alias(monkeypatch, tmp_path):
    from common.config import Settings
    monkeypatch.delenv("RICORDO_MODELS_DIR", raising=False)
    monkeypatch.setenv("RICORDO_MODELS", str(tmp_path))
    assert Settings.load("renderer", []).models_path() == str(tmp_path)
    monkeypatch.setenv("RICORDO_MODELS_DIR", str(tmp_path / "x"))
    assert Settings.load("renderer", []).models_path() == str(tmp_path / "x")
