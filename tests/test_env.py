"""tilekit.env: every environment variable tilekit reads is checked, and a bad value is an error naming it."""

import os
import subprocess
import sys

import pytest

from tilekit import env
from tilekit.autotune import store

VARIABLES = ("TILEKIT_AUTOTUNE", "TILEKIT_DEPENDENT_LAUNCH", "TILEKIT_PEER_ALL_REDUCE_BYTES", "TILEKIT_CACHE_DIR", "TILEKIT_SHIPPED_DB",
             "HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


@pytest.fixture(autouse=True)
def clean(monkeypatch, tmp_path):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def test_defaults():
    assert (env.autotune_mode(), env.dependent_launch(), env.cache_dir(), env.shipped_dir()) == ("cached", True,
                                                                                                None, None)
    assert env.peer_all_reduce_bytes() == 1 << 20
    env.check()


def test_the_peer_all_reduce_limit(monkeypatch):
    for value, parsed in (("0", 0), (" 65536 ", 65536), ("", 1 << 20), ("16777216", 1 << 24), ("1000000", 10 ** 6)):
        monkeypatch.setenv("TILEKIT_PEER_ALL_REDUCE_BYTES", value)
        assert env.peer_all_reduce_bytes() == parsed


@pytest.mark.parametrize("name, value, parsed", [
    ("TILEKIT_AUTOTUNE", " Auto ", "auto"), ("TILEKIT_AUTOTUNE", "", "cached"), ("TILEKIT_AUTOTUNE", "off", "off"),
    ("TILEKIT_DEPENDENT_LAUNCH", "0", False), ("TILEKIT_DEPENDENT_LAUNCH", " 1 ", True),
    ("TILEKIT_DEPENDENT_LAUNCH", "", True)])
def test_good_values(monkeypatch, name, value, parsed):
    monkeypatch.setenv(name, value)
    assert (env.autotune_mode() if name == "TILEKIT_AUTOTUNE" else env.dependent_launch()) == parsed


@pytest.mark.parametrize("name, value, message", [
    ("TILEKIT_AUTOTUNE", "sometimes", "TILEKIT_AUTOTUNE='sometimes' is not one of off, cached, auto"),
    ("TILEKIT_AUTOTUNE", "\x1b[2Jon", "TILEKIT_AUTOTUNE='\\x1b[2Jon' is not one of off, cached, auto"),
    ("TILEKIT_DEPENDENT_LAUNCH", "false", "TILEKIT_DEPENDENT_LAUNCH='false' is not one of 0, 1"),
    ("TILEKIT_DEPENDENT_LAUNCH", "2", "TILEKIT_DEPENDENT_LAUNCH='2' is not one of 0, 1"),
    ("TILEKIT_PEER_ALL_REDUCE_BYTES", "1MB", "TILEKIT_PEER_ALL_REDUCE_BYTES='1MB' is not an integer in [0, 16777216]"),
    ("TILEKIT_PEER_ALL_REDUCE_BYTES", "16777217",
     "TILEKIT_PEER_ALL_REDUCE_BYTES='16777217' is not an integer in [0, 16777216]"),
    ("TILEKIT_PEER_ALL_REDUCE_BYTES", "1048577", "TILEKIT_PEER_ALL_REDUCE_BYTES='1048577' is not a multiple of 16 (the "
     "peer inboxes' slots lie this many bytes apart, and each must start aligned for any dtype)"),
    ("TILEKIT_PEER_ALL_REDUCE_BYTES", " 1000 ", "TILEKIT_PEER_ALL_REDUCE_BYTES=' 1000 ' is not a multiple of 16 (the "
     "peer inboxes' slots lie this many bytes apart, and each must start aligned for any dtype)"),
])
def test_bad_choices_name_the_variable(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        env.check()
    assert str(info.value) == message


def test_a_shipped_database_that_is_not_there_is_an_error_not_an_empty_layer(monkeypatch, tmp_path):
    """A typo must not silently leave every kernel on its untuned default."""
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(tmp_path / "tunig_db"))
    store.reset()
    message = (f"TILEKIT_SHIPPED_DB='{tmp_path}/tunig_db': no such directory (unset it to use the tuning database "
               "packaged with tilekit)")
    for action in (env.check, store.layers, store.shipped_db):
        with pytest.raises(ValueError) as info:
            action()
        assert str(info.value) == message
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(tmp_path / "file"))
    with pytest.raises(ValueError, match="^TILEKIT_SHIPPED_DB='.*/file': not a directory "):
        store.layers()
    (tmp_path / "ship").mkdir()
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(tmp_path / "ship"))
    assert store.shipped_dir() == tmp_path / "ship"                 # empty: an empty database
    (tmp_path / "ship" / "README.md").write_text("")                # a directory of something else
    with pytest.raises(ValueError, match="^TILEKIT_SHIPPED_DB='.*/ship': not a tuning database "):
        store.shipped_dir()
    (tmp_path / "ship" / "sm_90").mkdir()
    assert store.shipped_dir() == tmp_path / "ship"
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", "")
    assert store.shipped_dir().name == "tuning_db"                  # empty: unset, the packaged database


@pytest.mark.parametrize("name, after", [
    ("TILEKIT_SHIPPED_DB", " (unset it to use the tuning database packaged with tilekit)"),
    ("TILEKIT_CACHE_DIR", "")])
def test_a_database_path_too_long_is_an_error_naming_the_variable(monkeypatch, tmp_path, name, after):
    """(Such a cache directory made every kernel's tuning lookup raise OSError: the user database's listing.)"""
    monkeypatch.setenv(name, str(tmp_path / ("a" * 300)))
    for action in (env.check, store.layers):
        store.reset()
        with pytest.raises(ValueError) as info:
            action()
        assert str(info.value).startswith(f"{name}='{tmp_path}/aaa")
        assert str(info.value).endswith("'...: cannot be read (File name too long)" + after)


def test_a_cache_dir_too_long_for_the_database_files_is_an_error_naming_the_variable(monkeypatch, tmp_path):
    """A directory whose own path fits but whose database files' would not (PATH_MAX): named at startup, where
    every tuning write failed before; one just short enough is no error."""
    import errno
    from tilekit.autotune import db

    def deep(length):
        path = str(tmp_path)
        while len(path) < length:
            path += "/" + "a" * min(100, length - len(path) - 1)     # (100: below any file system's name limit)
        return path

    longest = os.pathconf(str(tmp_path), "PC_PATH_MAX") - 1            # (PATH_MAX counts the terminating NUL)
    room = len(str(env.CACHE_DEEPEST)) + 1
    monkeypatch.setenv("TILEKIT_CACHE_DIR", deep(longest - room))
    assert env.cache_dir() is not None
    monkeypatch.setenv("TILEKIT_CACHE_DIR", deep(longest - room + 2))  # (+1 could end in a bare "/", which Path drops)
    for action in (env.check, store.layers):
        store.reset()
        with pytest.raises(ValueError) as info:
            action()
        assert str(info.value).endswith(f"'...: too long for the tuning database's files in it "
                                        f"({os.strerror(errno.ENAMETOOLONG)})")
    writer_file = f".{'x' * db.MAX_NAME}.json.{'0' * 16}.tmp"          # db's temporary name of its longest file
    assert len(env.CACHE_DEEPEST.name) >= len(writer_file)


def test_an_empty_home_is_no_home(monkeypatch):
    """Python makes ~/x the root's /x when HOME is set but empty."""
    monkeypatch.setenv("HOME", "")
    monkeypatch.setenv("TILEKIT_CACHE_DIR", "~/tk")
    with pytest.raises(FileNotFoundError) as info:
        env.check()
    assert str(info.value) == "TILEKIT_CACHE_DIR '~/tk': no home directory (HOME is empty)"


def test_a_cache_dir_not_made_yet_or_behind_a_file_is_no_error_at_startup(monkeypatch, tmp_path):
    """The database's own error names a file on the way when it writes."""
    (tmp_path / "file").write_text("")
    for path in (tmp_path / "new" / "dir", tmp_path / "file", tmp_path / "file" / "below"):
        monkeypatch.setenv("TILEKIT_CACHE_DIR", str(path))
        store.reset()
        assert env.cache_dir() == path and store.user_db().device_files() == []


@pytest.mark.parametrize("name", ["TILEKIT_CACHE_DIR", "TILEKIT_SHIPPED_DB", "HF_HUB_CACHE", "HF_HOME",
                                  "XDG_CACHE_HOME"])
def test_an_unknown_user_is_an_error_naming_the_variable(monkeypatch, name):
    monkeypatch.setenv(name, "~nosuchuser_tilekit/x")
    with pytest.raises(FileNotFoundError) as info:
        env.check()
    assert str(info.value) == f"{name} '~nosuchuser_tilekit/x': no user 'nosuchuser_tilekit'"


def test_paths_expand_home(monkeypatch, tmp_path):
    monkeypatch.setenv("TILEKIT_CACHE_DIR", "~/tk")
    assert store.user_dir() == tmp_path / "home" / "tk"
    monkeypatch.setenv("HF_HOME", "~/hf")
    assert env.hub_cache_dir() == (tmp_path / "home" / "hf" / "hub", "HF_HOME")


def test_a_bad_dependent_launch_value_stops_the_import_naming_the_variable():
    environ = dict(os.environ, TILEKIT_DEPENDENT_LAUNCH="yes")
    p = subprocess.run([sys.executable, "-c", "import tilekit.autotune.op"], env=environ, capture_output=True,
                       text=True)
    assert p.returncode != 0 and p.stderr.strip().splitlines()[-1] == (
        "ValueError: TILEKIT_DEPENDENT_LAUNCH='yes' is not one of 0, 1")


def test_the_hub_cache_is_found_as_huggingface_hub_finds_it(tmp_path, monkeypatch):
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    default = "XDG_CACHE_HOME or ~/.cache"
    assert env.hub_cache_dir() == (tmp_path / "home" / ".cache" / "huggingface" / "hub", default)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert env.hub_cache_dir() == (tmp_path / "xdg" / "huggingface" / "hub", default)
    monkeypatch.setenv("HF_HOME", "~/hf")
    assert env.hub_cache_dir() == (tmp_path / "home" / "hf" / "hub", "HF_HOME")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert env.hub_cache_dir() == (tmp_path / "cache", "HF_HUB_CACHE")
