"""Hostile model files and names through the command line (`tilekit db explain --model`, which reads a checkpoint's
config.json as `tune --model` does): exit 2, one `tilekit: ...` line naming the file and the problem, control
characters escaped, no hang and no traceback."""

import json
import os
from pathlib import Path

import pytest

from tilekit import cli

DATA = Path(__file__).resolve().parents[1] / "data"


pytestmark = pytest.mark.usefixtures("no_hang")


@pytest.fixture(autouse=True)
def empty_shipped(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(tmp_path / "no-shipped"))
    (tmp_path / "no-shipped").mkdir()


def explain(model: str, capsys) -> str:
    rc = cli.main(["db", "explain", "--model", model, "--gpu", "NVIDIA H100 80GB HBM3"])
    out, err = capsys.readouterr()
    assert (rc, out) == (2, ""), (rc, out, err)
    assert err.startswith("tilekit: --model ") and err.count("\n") == 1, err
    assert all(c.isprintable() for c in err[:-1]), err
    return err.rstrip("\n").partition("nor a usable checkpoint or config.json: ")[2]


def tiny(tmp_path: Path, **changes) -> Path:
    d = tmp_path / "ck"
    d.mkdir()
    for f in (DATA / "tiny-llama").iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({k: v for k, v in {**config, **changes}.items() if v is not None}))
    return d


def test_a_good_checkpoint_is_explained(tmp_path, capsys):
    assert cli.main(["db", "explain", "--model", str(tiny(tmp_path)), "--gpu", "NVIDIA H100 80GB HBM3"]) == 0
    assert "linear" in capsys.readouterr().out


@pytest.mark.parametrize("changes, problem", [
    ({"rope_theta": 5e-324, "rope_parameters": None},
     "field 'rope_theta' is 5e-324: it gives rotary frequencies that are not finite and > 0 (with head_dim 16)"),
    ({"model_type": "gpt_bigcode"}, 'field \'model_type\' is "gpt_bigcode", expected one of "gpt2", "llama", "deepseek_v2"'),
    ({"num_hidden_layers": 2.7}, "field 'num_hidden_layers' is 2.7, expected an integer in [1, 4096]"),
    ({"hidden_act": "\x1b[2J"}, "field 'hidden_act' is \"\\u001b[2J\", a variant tilekit does not compute"),
])
def test_config_fields(tmp_path, capsys, changes, problem):
    d = tiny(tmp_path, **changes)
    assert explain(str(d), capsys) == f"{d}/config.json: {problem}"
    assert explain(str(d / "config.json"), capsys) == f"{d}/config.json: {problem}"


def test_special_files_links_and_sizes(tmp_path, capsys):
    d = tiny(tmp_path)
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")
    assert explain(str(d), capsys) == f"{d}/config.json: is not a regular file but a FIFO"
    (d / "config.json").unlink()
    (tmp_path / "outside.json").write_bytes((DATA / "tiny-llama" / "config.json").read_bytes())
    (d / "config.json").symlink_to(tmp_path / "outside.json")
    assert explain(str(d), capsys) == f"{d}/config.json: resolves to {tmp_path}/outside.json, outside {d}"
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    assert explain(str(tmp_path / "zero.json"), capsys) == f"{tmp_path}/zero.json: is not a regular file but a " \
                                                            "character device"
    (tmp_path / "huge.json").touch()
    os.truncate(tmp_path / "huge.json", 64 << 20)
    assert explain(str(tmp_path / "huge.json"), capsys) == f"{tmp_path}/huge.json: is larger than 32 MiB"


def test_names_users_and_the_hub_cache(tmp_path, capsys, monkeypatch):
    assert explain("~nosuchuser_tilekit/m", capsys) == \
        "checkpoint path '~nosuchuser_tilekit/m': no user 'nosuchuser_tilekit'"
    name = "x" * 5000
    assert explain(name, capsys) == f"checkpoint path {name[:200]!r}... (5000 characters) is too long"
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", "~nosuchuser_tilekit")
    rc = cli.main(["db", "explain", "--model", "org/m", "--gpu", "NVIDIA H100 80GB HBM3"])   # refused up front
    assert (rc, capsys.readouterr()) == (2, ("", "tilekit: HF_HOME '~nosuchuser_tilekit': no user 'nosuchuser_tilekit'\n"))
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hub"))
    monkeypatch.chdir(tmp_path)
    assert explain("gpt2\x1b[2J", capsys) == f"no checkpoint 'gpt2\\x1b[2J'; searched: {tmp_path}/gpt2\\x1b[2J"
