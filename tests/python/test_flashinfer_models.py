"""The example decoders (examples/llama.py, gpt_oss.py, gemma2.py) with their
attention on attnserve through the FlashInfer-style wrappers
(decoder.FlashInferAttention), over every transport a CPU machine has:
grpc, shm and channel. Each run follows the local run's tokens, so that every
step's logits compare; its own greedy tokens must be identical to the local
run's, hence to each other's."""

import json

import pytest
import torch

import attnserve
import decoder
import gemma2
import gpt_oss
import llama
from server import TestServer

STEPS = 5
MODELS = {"llama": llama, "gpt_oss": gpt_oss, "gemma2": gemma2}
TRANSPORTS = ["grpc", "shm", "channel"]


@pytest.fixture(scope="module")
def server():
    with TestServer(extra_flags=["--allow_shared_memory"]) as s:
        yield s


@pytest.fixture(scope="module")
def local_runs():
    """Each model's local run, once."""
    runs = {}
    for name, module in MODELS.items():
        preset = module.PRESETS["small"]
        cfg = preset["config"]
        model = module.Model(cfg, seed=3)
        prompts = decoder.random_prompts(cfg.vocab, 3, *preset["prompt_len"], seed=4)
        local = decoder.generate(model, decoder.LocalAttention(cfg, "cpu", torch.bfloat16,
                                                               model.attention_probs),
                                 prompts, STEPS, torch.bfloat16, "local")
        runs[name] = (model, prompts, local)
    return runs


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_identical_on_every_transport(server, local_runs, name, transport):
    model, prompts, local = local_runs[name]
    with attnserve.Client(server.address, timeout=120) as client:
        free = client.info().free_pages
        attn = decoder.FlashInferAttention(
            client, decoder.pages_for(prompts, STEPS, client.server_info.page_size), model,
            transport)
        assert attn.cache.transport == transport
        run = decoder.generate(model, attn, prompts, STEPS, torch.bfloat16, "server",
                               follow=local.tokens)
        assert client.info().free_pages == free             # the cache closed with the run
    c = decoder.compare_runs(run, local, 2e-2)
    assert c["ok"] and c["tokens_identical"], c
    assert len(run.round_trips) == model.cfg.layers * (STEPS + 1)
    # Not trivially equal: the sequences' tokens differ.
    assert len(set(local.tokens.flatten().tolist())) > 1


def test_models_group_layers_by_their_attention(server, local_runs):
    """gpt-oss alternates windowed and full layers, each with sinks: one pair
    of wrappers per window, the sinks passed to run(); Gemma 2 adds the
    soft-cap to both of its groups."""
    with attnserve.Client(server.address, timeout=120) as client:
        for name, groups in (("gpt_oss", {(127, None), (-1, None)}),
                             ("gemma2", {(15, 50.0), (-1, 50.0)}),
                             ("llama", {(-1, None)})):
            model = local_runs[name][0]
            attn = decoder.FlashInferAttention(client, 4, model)
            try:
                assert set(attn.groups) == groups
                assert all((s is not None) == (name == "gpt_oss") for s in attn.layer_sinks)
            finally:
                attn.close()


@pytest.mark.parametrize("transport", ["channel", "shm"])
def test_main_with_a_transport(server, tmp_path, transport):
    out = tmp_path / "report.json"
    code = llama.main(["--target", server.address, "--attention", "all", "--transport",
                       transport, "--batch", "2", "--steps", "3", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["transport"] == transport
    assert [r["mode"] for r in report["runs"]] == ["local", "server", "pingpong"]
    for c in report["comparisons"].values():
        assert c["ok"] and c["tokens_identical"], c


def test_main_kvmanager_mode(server, tmp_path):
    out = tmp_path / "report.json"
    code = gpt_oss.main(["--target", server.address, "--attention", "kvmanager",
                         "--no_server_plans", "--batch", "2", "--steps", "2",
                         "--json", str(out)])
    assert code == 0
    assert [r["mode"] for r in json.loads(out.read_text())["runs"]] == ["kvmanager"]


def test_main_refuses_cuda_without_a_gpu(server, capsys):
    code = llama.main(["--target", server.address, "--attention", "server", "--transport",
                       "cuda", "--steps", "1"])
    assert code == 2
    assert "--transport=cuda: transport='cuda' needs a GPU here" in capsys.readouterr().err


@pytest.mark.parametrize("transport", ["grpc", "channel"])
def test_main_against_an_fp8_server(tmp_path, transport):
    """examples/llama.py's server modes on an FP8 cache (the wrappers planned
    with the cache's FP8 kv_data_type, 16-bit rows quantized by the server
    with --kv_scale) agree within bf16's tolerance with local attention over
    the same FP8 rows (local_fp8, computed here from the format's definition),
    and their move from local bf16 attention is reported: larger than bf16's
    tolerance, not checked."""
    out = tmp_path / "report.json"
    with TestServer(kv_dtype="fp8_e4m3", extra_flags=["--allow_shared_memory"]) as fp8:
        code = llama.main(["--target", fp8.address, "--attention", "all", "--transport",
                           transport, "--kv_scale", "0.05", "--batch", "2", "--steps", "3",
                           "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["server_kv_dtype"] == "fp8_e4m3"
    assert [r["mode"] for r in report["runs"]] == ["local", "local_fp8", "server", "pingpong"]
    comparisons = report["comparisons"]
    for mode in ("server", "pingpong"):
        c = comparisons[f"{mode}_vs_local_fp8"]
        assert c["checked"] and c["ok"] and c["max_logits_rel_error"] < 2e-3, c
        drift = comparisons[f"{mode}_vs_local"]
        assert not drift["checked"] and drift["kv_dtypes"] == ["fp8_e4m3", "bf16"], drift
        assert drift["max_logits_rel_error"] > 2e-3, drift
    assert comparisons["local_fp8_vs_local"]["kv_dtypes"] == ["fp8_e4m3", "bf16"]


def test_local_fp8_catches_a_server_with_other_scales(tmp_path):
    """The check can fail: a server whose KV scales differ from the ones the
    example set (here another client changed them to 0.002 after the example
    had, which the example cannot know: rows past 448 x 0.002 saturate)
    disagrees with local_fp8, and the run fails."""
    out = tmp_path / "report.json"
    with TestServer(kv_dtype="fp8_e4m3") as fp8:
        real_init = decoder.LocalAttention.__init__

        def init(self, *args, **kwargs):       # local_fp8 expects scales of 0.05...
            real_init(self, *args, **kwargs)
            if self.kv_fp8 is not None:
                with attnserve.Client(fp8.address) as other:   # ...the server holds 0.002
                    other.set_kv_scales({layer: (0.002, 0.002) for layer in range(2)})
        decoder.LocalAttention.__init__ = init
        try:
            code = llama.main(["--target", fp8.address, "--attention", "local,kvmanager",
                               "--kv_scale", "0.05", "--batch", "2", "--steps", "2",
                               "--json", str(out)])
        finally:
            decoder.LocalAttention.__init__ = real_init
    assert code == 1
    c = json.loads(out.read_text())["comparisons"]["kvmanager_vs_local_fp8"]
    assert c["checked"] and not c["ok"] and c["max_logits_rel_error"] > 0.1, c


def test_fp8_rel_tol_checks_the_move_from_bf16(tmp_path):
    out = tmp_path / "report.json"
    with TestServer(kv_dtype="fp8_e4m3") as fp8:
        code = llama.main(["--target", fp8.address, "--attention", "local,kvmanager",
                           "--kv_scale", "0.05", "--fp8_rel_tol", "1e-3", "--batch", "2",
                           "--steps", "2", "--json", str(out)])
    assert code == 1
    comparisons = json.loads(out.read_text())["comparisons"]
    assert comparisons["kvmanager_vs_local_fp8"]["ok"]
    drift = comparisons["kvmanager_vs_local"]
    assert drift["checked"] and not drift["ok"], drift
