"""`text-generation-server` weights tools on a local HF cache: convert, serve by hub id, errors, download."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import GPT2Config, GPT2LMHeadModel

from tests import launcher
from tests.fixtures.hub_cache import install_in_hub_cache
from tests.fixtures.tiny import BOS_ID, EOS_ID, PAD_ID, train_tokenizer
from tests.integration import reference
from tests.integration.harness import ServerThread, wait_until
from tgis import cli
from tgis.hub import resolve_model_path
from tgis.model_files import WeightsError, download
from tgis.model_files.convert import split_shared_tensors, tied_or_ignored_names
from tgis.model_files.selection import parse_extensions, select_hub_files
from tgis.model_files.tokenizer import convert_to_fast_tokenizer
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

SERVER = shutil.which("text-generation-server", path=str(Path(sys.executable).parent))
HF_VARS = (
    "HF_HUB_CACHE",
    "HF_HOME",
    "TRANSFORMERS_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_TOKEN",
    "HF_ENDPOINT",
)
PROMPT = "The list"
SPEC_PARALLEL_DOWNLOADS = 5


# ---------------------------------------------------------------- helpers


def cli_env(hub: Path, **extra: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in HF_VARS}
    return {**env, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", **extra}


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    assert SERVER is not None, "text-generation-server is not installed beside this Python"
    return subprocess.run([SERVER, *args], env=env, capture_output=True, text=True, timeout=120)


def run_in_process(monkeypatch: pytest.MonkeyPatch, hub: Path, *args: str) -> int:
    """The same CLI entry point, in this process (so the test can fake the hub client)."""
    for name in HF_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(sys, "argv", ["text-generation-server", *args])
    with pytest.raises(SystemExit) as exited:
        cli.server_main()
    return int(exited.value.code or 0)


def assert_one_error_line(result: subprocess.CompletedProcess[str], message: str) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.splitlines() == [f"ERROR: {message}"]


def assert_same_tensors(converted_files: list[Path], original: dict[str, torch.Tensor]) -> dict[str, str]:
    """Every original tensor equals its stored copy (direct or via an alias); returns the aliases."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for path in converted_files:
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata()
        assert metadata.pop("format") == "pt"
        aliases |= metadata
        stored |= load_file(path)
    assert set(stored) | set(aliases) == set(original)
    assert not set(stored) & set(aliases)
    for name, tensor in original.items():
        again = stored[aliases.get(name, name)]
        assert again.dtype == tensor.dtype and torch.equal(again, tensor), name
    return aliases


def greedy_answer(stub: pb_grpc.GenerationServiceStub, max_new_tokens: int = 8) -> pb.GenerationResponse:
    params = pb.Parameters(method=pb.GREEDY, stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens))
    request = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=PROMPT)], params=params)
    return stub.Generate(request, timeout=60).responses[0]


def tied_gpt2(out_dir: Path, tokenizer_dir: Path) -> Path:
    """A tiny GPT-2 whose lm_head is the token embedding (saved deduplicated, as transformers does)."""
    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    config = GPT2Config(
        vocab_size=vocab, n_positions=256, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3,
        tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(7)
        model = GPT2LMHeadModel(config).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def shard_as_bin(model_dir: Path, out_dir: Path) -> dict[str, torch.Tensor]:
    """`model_dir` as a legacy 2-shard pytorch checkpoint with its index, plus training-state files.

    The state dict comes from the live model, so tied names share one tensor inside shard 1.
    """
    out_dir.mkdir()
    for item in model_dir.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, out_dir / item.name)
    state = GPT2LMHeadModel.from_pretrained(model_dir).state_dict()
    names = list(state)
    first = [*names[: len(names) // 2], "lm_head.weight"]
    shards = {
        "pytorch_model-00001-of-00002.bin": first,
        "pytorch_model-00002-of-00002.bin": [name for name in names if name not in first],
    }
    for file, keys in shards.items():
        torch.save({key: state[key] for key in keys}, out_dir / file)
    weight_map = {key: file for file, keys in shards.items() for key in keys}
    total = sum(tensor.numel() * tensor.element_size() for tensor in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    torch.save({"learning_rate": torch.tensor(1e-4)}, out_dir / "training_args.bin")
    torch.save({"step": torch.tensor(3)}, out_dir / "optimizer.bin")
    return state


# ---------------------------------------------------------------- download-weights file selection


HUB_FILES = [
    "config.json", "generation_config.json", "README.md", "modeling_custom.py", "tokenizer.model",
    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
    "pytorch_model.bin", "training_args.bin", "optimizer.pt", "merges.txt", "args.json",
    "adapter_arguments.json", "onnx/model.onnx", "subfolder/config.json", "subfolder/model.safetensors",
]  # fmt: skip


def test_one_weights_extension_also_takes_the_metadata_extensions():
    assert parse_extensions(".safetensors") == [".safetensors", ".json", ".py", ".model", ".md"]
    assert parse_extensions(".bin") == [".bin", ".json", ".py", ".model", ".md"]


def test_several_or_metadata_extensions_are_taken_as_given():
    assert parse_extensions(".bin,.safetensors") == [".bin", ".safetensors"]
    assert parse_extensions(".json") == [".json"]
    assert parse_extensions(".safetensors, .txt") == [".safetensors", ".txt"]


def test_default_selection_is_top_level_safetensors_and_metadata_without_training_files():
    selected = select_hub_files(HUB_FILES, parse_extensions(".safetensors"))
    assert selected == [
        "README.md", "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "modeling_custom.py",
        "tokenizer.model",
    ]  # fmt: skip


def test_bin_selection_skips_arguments_args_and_training_files():
    assert select_hub_files(HUB_FILES, [".bin"]) == ["pytorch_model.bin"]
    assert select_hub_files(HUB_FILES, [".json"]) == [
        "config.json", "generation_config.json", "model.safetensors.index.json",
    ]  # fmt: skip


def test_nothing_matching_selects_nothing():
    assert select_hub_files(HUB_FILES, [".gguf"]) == []


# ---------------------------------------------------------------- shared tensors


def test_aliases_keep_the_name_the_architecture_does_not_tie(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["T5ForConditionalGeneration"]}))
    shared, other = torch.randn(8, 4), torch.randn(3)
    state = {
        "decoder.embed_tokens.weight": shared, "encoder.embed_tokens.weight": shared,
        "lm_head.weight": shared, "shared.weight": shared, "encoder.final_layer_norm.weight": other,
    }  # fmt: skip
    split = split_shared_tensors(state, lambda: tied_or_ignored_names(tmp_path / "config.json"))
    assert split.aliases == {
        "decoder.embed_tokens.weight": "shared.weight",
        "encoder.embed_tokens.weight": "shared.weight",
        "lm_head.weight": "shared.weight",
    }
    assert set(split.tensors) == {"shared.weight", "encoder.final_layer_norm.weight"}


def test_without_a_known_architecture_the_first_name_is_kept():
    shared = torch.randn(4, 4)
    split = split_shared_tensors({"b.weight": shared, "a.weight": shared}, lambda: [])
    assert split.aliases == {"b.weight": "a.weight"}


def test_the_architecture_is_only_looked_up_when_there_are_aliases():
    def no_lookup() -> list[str]:
        raise AssertionError("looked up tied names without any alias")

    split = split_shared_tensors({"a": torch.randn(2), "b": torch.randn(2)}, no_lookup)
    assert split.aliases == {}


def test_distinct_views_of_one_storage_are_saved_as_separate_tensors(tmp_path):
    fused = torch.randn(6, 4)
    state = {"q": fused[:2], "k": fused[2:4], "v": fused[4:], "t": fused.t()}
    split = split_shared_tensors(state, lambda: [])
    assert split.aliases == {}
    save_file(split.tensors, tmp_path / "x.safetensors")  # refuses tensors that share memory
    reloaded = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(reloaded[name], state[name]) for name in state)


# ---------------------------------------------------------------- convert, then serve


def test_converted_bin_checkpoint_is_served_by_hub_id_with_the_same_greedy_answer(model_dirs, tmp_path):
    hub = tmp_path / "hub"
    snapshot = install_in_hub_cache(model_dirs("gpt2"), hub, "acme/tiny-gpt2", as_bin=True)
    original = torch.load(snapshot / "pytorch_model.bin", weights_only=True)

    result = run_cli(cli_env(hub), "convert-to-safetensors", "acme/tiny-gpt2")

    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert assert_same_tensors([snapshot / "model.safetensors"], original) == {}
    (snapshot / "pytorch_model.bin").unlink()  # served from the conversion only
    run = launcher.Launched(
        launcher.launcher_env(MODEL_NAME="acme/tiny-gpt2", HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    )
    try:
        port = wait_until(
            lambda: run.port("gRPC") or run.process.poll() is not None, "the gRPC port is logged", timeout=240
        )
        assert run.process.poll() is None, run.log()
        with grpc.insecure_channel(f"localhost:{port}") as channel:
            answer = greedy_answer(pb_grpc.GenerationServiceStub(channel))
        expected = reference.greedy(model_dirs("gpt2"), PROMPT, 8)
        assert (answer.text, answer.generated_token_count) == (expected.text, expected.generated_token_count)
        run.process.send_signal(signal.SIGTERM)
        assert run.process.wait(30) == 0, run.log()
    finally:
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait(10)


def test_sharded_tied_checkpoint_converts_with_alias_metadata_and_index(model_dirs, tmp_path, monkeypatch):
    reference_dir = tied_gpt2(tmp_path / "tied", model_dirs("gpt2"))
    original = shard_as_bin(reference_dir, tmp_path / "as-bin")
    hub = tmp_path / "hub"
    snapshot = install_in_hub_cache(tmp_path / "as-bin", hub, "acme/tied-gpt2")

    assert run_in_process(monkeypatch, hub, "convert-to-safetensors", "acme/tied-gpt2") == 0

    shards = [snapshot / "model-00001-of-00002.safetensors", snapshot / "model-00002-of-00002.safetensors"]
    assert sorted(path.name for path in snapshot.glob("*.safetensors")) == [path.name for path in shards]
    aliases = assert_same_tensors(shards, original)
    assert aliases == {"lm_head.weight": "transformer.wte.weight"}
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())
    stored = {name: path.name for path in shards for name in load_file(path)}
    assert index["weight_map"] == stored
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for name, t in original.items() if name not in aliases
    )
    for legacy in [*snapshot.glob("*.bin"), snapshot / "pytorch_model.bin.index.json"]:
        legacy.unlink()  # served from the conversion only
    server = ServerThread(snapshot)
    try:
        answer = greedy_answer(server.stub)
    finally:
        server.stop()
    expected = reference.greedy(reference_dir, PROMPT, 8)
    assert (answer.text, answer.generated_token_count) == (expected.text, expected.generated_token_count)


# ---------------------------------------------------------------- convert: what stops it


def test_no_bin_files_is_reported(model_dirs, tmp_path):
    hub = tmp_path / "hub"
    install_in_hub_cache(model_dirs("gpt2"), hub, "acme/safe")
    result = run_cli(cli_env(hub), "convert-to-safetensors", "acme/safe")
    assert_one_error_line(result, "No pytorch .bin files found to convert")


def test_more_than_one_bin_index_is_reported_and_nothing_converted(model_dirs, tmp_path):
    hub = tmp_path / "hub"
    snapshot = install_in_hub_cache(model_dirs("gpt2"), hub, "acme/two-indexes", as_bin=True)
    for name in ("a.bin.index.json", "b.bin.index.json"):
        (snapshot / name).write_text('{"weight_map": {}}')
    result = run_cli(cli_env(hub), "convert-to-safetensors", "acme/two-indexes")
    message = f"Found more than one .bin.index.json file in {snapshot}: a.bin.index.json, b.bin.index.json"
    assert_one_error_line(result, message)
    assert not list(snapshot.glob("*.safetensors"))


def test_an_index_naming_a_missing_shard_is_reported(model_dirs, tmp_path):
    hub = tmp_path / "hub"
    snapshot = install_in_hub_cache(model_dirs("gpt2"), hub, "acme/partial", as_bin=True)
    index = {"weight_map": {"a": "pytorch_model.bin", "b": "pytorch_model-00002-of-00002.bin"}}
    (snapshot / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    result = run_cli(cli_env(hub), "convert-to-safetensors", "acme/partial")
    missing = "pytorch_model-00002-of-00002.bin"
    message = f"pytorch_model.bin.index.json lists {missing}, which is missing from {snapshot}"
    assert_one_error_line(result, message)


def test_an_existing_target_stops_the_conversion_untouched(model_dirs, tmp_path):
    hub = tmp_path / "hub"
    snapshot = install_in_hub_cache(model_dirs("gpt2"), hub, "acme/done", as_bin=True)
    (snapshot / "model.safetensors").write_bytes(b"previous")
    result = run_cli(cli_env(hub), "convert-to-safetensors", "acme/done")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "Existing .safetensors weights found, remove them first to re-convert: model.safetensors"
    ]
    assert (snapshot / "model.safetensors").read_bytes() == b"previous"


@pytest.mark.parametrize("command", ["convert-to-safetensors", "convert-to-fast-tokenizer"])
def test_a_model_missing_from_the_cache_is_named(tmp_path, command):
    result = run_cli(cli_env(tmp_path / "hub"), command, "acme/missing", "--revision", "v2")
    assert_one_error_line(
        result,
        f"Model acme/missing not found: looked for revision v2 in the HF cache at {tmp_path / 'hub'} "
        "(HF_HUB_CACHE); fetch it with `text-generation-server download-weights acme/missing`",
    )


# ---------------------------------------------------------------- convert-to-fast-tokenizer


def slow_gpt2_tokenizer(out_dir: Path) -> Path:
    """GPT-2 style slow-tokenizer files only (vocab.json + merges.txt), no tokenizer.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer("gpt2").model.save(str(out_dir))
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<s>", "eos_token": "</s>",
              "pad_token": "<pad>", "unk_token": "<unk>", "add_prefix_space": False}  # fmt: skip
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return out_dir


def test_fast_tokenizer_is_written_to_the_output_path(tmp_path):
    model_dir = slow_gpt2_tokenizer(tmp_path / "model")
    out = tmp_path / "out"
    out.mkdir()
    result = run_cli(
        cli_env(tmp_path / "hub"), "convert-to-fast-tokenizer", str(model_dir), "--output-path", str(out)
    )
    assert result.returncode == 0, result.stderr
    assert f"Saved tokenizer to {out}" in result.stdout.splitlines()
    assert not (model_dir / "tokenizer.json").exists()
    text = "naïve café — 日本語 👍🏽 and  spaces"
    written = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert written.encode(text).ids == train_tokenizer("gpt2").encode(text).ids


def test_fast_tokenizer_conversion_stops_when_there_is_one_or_the_output_is_no_directory(
    model_dirs, tmp_path
):
    env = cli_env(tmp_path / "hub")
    model = str(model_dirs("gpt2"))
    result = run_cli(env, "convert-to-fast-tokenizer", model)
    assert (result.returncode, result.stdout.splitlines()) == (
        0,
        [f"Model {model} already has a fast tokenizer"],
    )
    slow = slow_gpt2_tokenizer(tmp_path / "slow")
    result = run_cli(env, "convert-to-fast-tokenizer", str(slow), "--output-path", str(tmp_path / "nowhere"))
    assert_one_error_line(result, f"Output path {tmp_path / 'nowhere'} must exist and be a directory")


def test_a_sentencepiece_tokenizer_without_the_package_is_named(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "tokenizer.model").write_bytes(b"not read")
    (model_dir / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *rest: None if name == "sentencepiece" else find_spec(name, *rest),
    )
    with pytest.raises(WeightsError) as caught:
        convert_to_fast_tokenizer("acme/spm", model_dir)
    assert str(caught.value) == (
        f"No tokenizer could be loaded for model acme/spm from {model_dir}: "
        "reading its tokenizer.model needs the sentencepiece package (pip install sentencepiece)"
    )


# ---------------------------------------------------------------- download-weights


def test_download_weights_offline_fails_with_one_line(tmp_path):
    result = run_cli(cli_env(tmp_path / "hub"), "download-weights", "acme/tiny-gpt2")
    assert_one_error_line(
        result,
        "Cannot download the file list of model acme/tiny-gpt2: "
        "HF_HUB_OFFLINE is set, so the Hugging Face Hub is not contacted",
    )
    assert not (tmp_path / "hub").exists()


def test_download_weights_with_an_unreachable_hub_fails_with_one_line(tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{probe.getsockname()[1]}"
    env = cli_env(tmp_path / "hub", HF_HUB_OFFLINE="0", HF_ENDPOINT=endpoint)
    result = run_cli(env, "download-weights", "acme/tiny-gpt2", "--retries", "0")
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith(
        f"ERROR: Cannot download the file list of model acme/tiny-gpt2: "
        f"the Hugging Face Hub at {endpoint} cannot be reached ("
    )


@pytest.fixture
def silent_hub() -> Iterator[str]:
    """A "hub" that accepts every connection and never answers a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for connection in held:
        connection.close()
    server.close()


def test_download_weights_from_a_hub_that_never_answers_times_out_with_one_line(tmp_path, silent_hub):
    env = cli_env(
        tmp_path / "hub",
        HF_HUB_OFFLINE="0",
        HF_ENDPOINT=silent_hub,
        HF_HUB_DOWNLOAD_TIMEOUT="1",
        HF_HUB_ETAG_TIMEOUT="1",
    )
    result = run_cli(env, "download-weights", "acme/tiny-gpt2", "--retries", "1")
    assert_one_error_line(
        result,
        f"Cannot download the file list of model acme/tiny-gpt2: the Hugging Face Hub at {silent_hub} "
        "did not answer in time (2 attempts; timeouts HF_HUB_ETAG_TIMEOUT=1 s to connect, "
        "HF_HUB_DOWNLOAD_TIMEOUT=1 s to read)",
    )
    assert "retrying in 1 s" in result.stdout


class FakeHub:
    """Stands in for huggingface_hub: lists and 'downloads' a local directory into the HF cache layout.

    With `gate_parallel`, the first SPEC_PARALLEL_DOWNLOADS (5) calls wait (with a deadline) until that
    many run at once, so a smaller pool shows up as a lower peak and a larger one as a higher peak.
    """

    COMMIT = "c0ffee" * 6 + "c0ff"

    def __init__(self, source: Path) -> None:
        self.source = source
        self.fetched: list[str] = []
        self.listings: list[dict[str, object]] = []
        self.in_flight = 0
        self.peak = 0
        self.gate_parallel = False
        self.snapshot_calls: list[dict[str, object]] = []
        self._changed = threading.Condition()

    def files(self) -> list[str]:
        return sorted(str(path.relative_to(self.source)) for path in self.source.rglob("*") if path.is_file())

    def api(self) -> object:
        hub = self

        class FakeApi:
            def model_info(self, repo_id: str, *, revision=None, token=None, **_: object) -> SimpleNamespace:
                hub.listings.append({"repo_id": repo_id, "revision": revision, "token": token})
                return SimpleNamespace(siblings=[SimpleNamespace(rfilename=name) for name in hub.files()])

        return FakeApi

    def hf_hub_download(
        self, repo_id: str, filename: str, *, revision=None, token=None, cache_dir=None
    ) -> str:
        with self._changed:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            self.fetched.append(filename)
            self._changed.notify_all()
            if self.gate_parallel and len(self.fetched) <= SPEC_PARALLEL_DOWNLOADS:
                self._changed.wait_for(lambda: self.peak >= SPEC_PARALLEL_DOWNLOADS, timeout=10)
        try:
            repo = Path(cache_dir) / f"models--{repo_id.replace('/', '--')}"
            target = repo / "snapshots" / self.COMMIT / filename
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.source / filename, target)
            (repo / "refs").mkdir(exist_ok=True)
            (repo / "refs" / (revision or "main")).write_text(self.COMMIT)
            return str(target)
        finally:
            with self._changed:
                self.in_flight -= 1

    def snapshot_download(
        self, repo_id: str, *, revision=None, token=None, cache_dir=None, allow_patterns=(), max_workers=8
    ) -> str:
        """huggingface_hub's: the files matching `allow_patterns`, `max_workers` at a time."""
        self.snapshot_calls.append({"allow_patterns": list(allow_patterns), "max_workers": max_workers})
        names = [name for name in self.files() if any(fnmatch(name, p) for p in allow_patterns)]
        with ThreadPoolExecutor(max_workers=max_workers) as pool:
            paths = list(
                pool.map(
                    lambda name: self.hf_hub_download(repo_id, name, revision=revision, cache_dir=cache_dir),
                    names,
                )
            )
        return str(Path(paths[0]).parent) if paths else ""


@pytest.fixture
def fake_hub(monkeypatch, tmp_path) -> Iterator[FakeHub]:
    hub = FakeHub(tmp_path / "remote")
    hub.source.mkdir()
    monkeypatch.setattr(download, "HfApi", hub.api())
    monkeypatch.setattr(download, "snapshot_download", hub.snapshot_download)
    yield hub


def publish_bin_model(remote: Path, model_dir: Path) -> dict[str, torch.Tensor]:
    """A hub repo with legacy weights and slow-tokenizer files only, plus files never to fetch."""
    shutil.copy(model_dir / "config.json", remote / "config.json")
    slow_gpt2_tokenizer(remote)
    state = load_file(model_dir / "model.safetensors")
    torch.save(state, remote / "pytorch_model.bin")
    torch.save({"lr": torch.tensor(0.1)}, remote / "training_args.bin")
    for name, text in [("README.md", "# tiny"), ("generation_config.json", "{}"), ("notes.txt", "x"),
                       ("nested/config.json", "{}"), ("adapter_arguments.json", "{}")]:  # fmt: skip
        (remote / name).parent.mkdir(exist_ok=True)
        (remote / name).write_text(text)
    return state


def test_download_fetches_in_parallel_then_converts_bin_weights_and_writes_tokenizer_json(
    fake_hub, model_dirs, tmp_path, monkeypatch, capsys
):
    original = publish_bin_model(fake_hub.source, model_dirs("gpt2"))
    fake_hub.gate_parallel = True
    hub = tmp_path / "hub"

    args = ("download-weights", "acme/legacy", "--extension", ".safetensors,.json,.txt,.md", "--token", "t0k")
    assert run_in_process(monkeypatch, hub, *args) == 0

    first_round = ["README.md", "config.json", "generation_config.json", "merges.txt", "notes.txt",
                   "tokenizer_config.json", "vocab.json"]  # fmt: skip
    assert sorted(fake_hub.fetched[: len(first_round)]) == first_round
    assert fake_hub.fetched[len(first_round) :] == ["pytorch_model.bin"]
    assert fake_hub.peak == SPEC_PARALLEL_DOWNLOADS
    assert [call["max_workers"] for call in fake_hub.snapshot_calls] == [SPEC_PARALLEL_DOWNLOADS] * 2
    assert fake_hub.snapshot_calls[1]["allow_patterns"] == ["pytorch_model.bin"]
    assert fake_hub.listings == [{"repo_id": "acme/legacy", "revision": None, "token": "t0k"}]
    out = capsys.readouterr().out
    assert ".safetensors weights not found, downloading pytorch weights to convert..." in out
    snapshot = resolve_model_path("acme/legacy", revision="main", cache_dir=hub)
    assert_same_tensors([snapshot / "model.safetensors"], original)
    text = "naïve café — 日本語 👍🏽"
    written = Tokenizer.from_file(str(snapshot / "tokenizer.json"))
    assert written.encode(text).ids == train_tokenizer("gpt2").encode(text).ids

    # The hub still has no safetensors; the local conversion is kept and the operator told so.
    fake_hub.fetched.clear()
    assert run_in_process(monkeypatch, hub, *args) == 0
    assert "pytorch_model.bin" not in fake_hub.fetched
    out = capsys.readouterr().out
    assert (
        ".safetensors weights not found on the hub, but were found locally. Remove them first to re-convert"
        in out.splitlines()
    )
    assert "Model acme/legacy already has a fast tokenizer" in out.splitlines()


def test_download_prefers_safetensors_and_skips_bin_when_the_hub_has_them(
    fake_hub, model_dirs, tmp_path, monkeypatch
):
    for item in model_dirs("gpt2").iterdir():
        shutil.copy(item, fake_hub.source / item.name)
    torch.save({"x": torch.zeros(1)}, fake_hub.source / "pytorch_model.bin")
    hub = tmp_path / "hub"

    assert run_in_process(monkeypatch, hub, "download-weights", "acme/modern", "--revision", "v1") == 0

    assert "pytorch_model.bin" not in fake_hub.fetched
    assert "model.safetensors" in fake_hub.fetched and "tokenizer.json" in fake_hub.fetched
    assert fake_hub.listings[0]["revision"] == "v1"
    snapshot = resolve_model_path("acme/modern", revision="v1", cache_dir=hub)
    assert sorted(path.name for path in snapshot.iterdir()) == sorted(
        path.name for path in model_dirs("gpt2").iterdir()
    )


def test_download_without_any_weights_on_the_hub_names_what_is_missing(
    fake_hub, tmp_path, monkeypatch, capsys
):
    (fake_hub.source / "config.json").write_text("{}")
    assert run_in_process(monkeypatch, tmp_path / "hub", "download-weights", "acme/empty") == 1
    err = capsys.readouterr().err  # above the error: the progress bar of the config.json download
    assert [line for line in err.splitlines() if line.startswith("ERROR")] == [
        "ERROR: No .safetensors or .bin files found for model acme/empty at revision main"
    ]
    assert err.endswith("ERROR: No .safetensors or .bin files found for model acme/empty at revision main\n")
