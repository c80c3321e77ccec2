"""``generate`` on torch and ``python -m experiments.generate`` end to end.

A smoke-scale PCAF-context run is trained by the table driver (what ``make reproduce-table SCALE=smoke``
runs), then the command (``python -m experiments.generate``, run in this process: tests/entry_points.py) generates
from it; greedy generation equals the argmax of the full AR forward over its own output; sampling is reproducible
by seed; errors are one line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from backends.torch import build_model
from backends.torch.generate import generate, sample_next
from experiments import generate as generate_cli
from pcaf_core.config import MemoryConfig, ModelConfig
from pcaf_core.profiles import get_profile
from pcaf_core.weights import load_canonical, save_canonical
from tests.entry_points import run_main


@pytest.fixture
def smoke_run(smoke_pcaf_run) -> Path:
    return smoke_pcaf_run


@pytest.mark.slow
def test_generate_command_end_to_end_from_a_smoke_table_run(smoke_run):
    res = run_main(generate_cli.main, [f"run_dir={smoke_run}", "prompt=The game was Zqxjv released in",
                                       "max_new_tokens=12", "seed=3"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "warning: prompt words not in the vocabulary, read as <unk>: 'Zqxjv'" in res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("[wt2-nt-1024/pcaf_context scale=smoke") and "profile=reference_torch" in lines[0]
    assert lines[1] == "prompt (6 tokens): The game was <unk> released in"
    words = lines[2].removeprefix("continuation: ").replace("\n", " ").split()
    assert lines[2].startswith("continuation: ") and 1 <= len(words) <= 12
    assert "tokens/s (backend=torch, dtype=fp32, batch=1, 12 new tokens" in lines[-1]


@pytest.mark.slow  # trains the shared smoke run
def test_generate_command_errors_are_one_line(smoke_run, tmp_path, capsys):
    assert generate_cli.main([f"run_dir={tmp_path / 'nope'}", "prompt=a"]) == 2
    assert "error: no run at" in capsys.readouterr().err
    # A checkpoint of another vocabulary: the run's weights with 5 more embedding rows.
    ckpt = next((smoke_run / "checkpoints").glob("step_*")) / "model.safetensors"
    params = load_canonical(ckpt)
    params["embed.weight"] = np.concatenate([params["embed.weight"], params["embed.weight"][:5]])
    save_canonical(tmp_path / "other.safetensors", params)
    other = tmp_path / "other.safetensors"
    assert generate_cli.main([f"run_dir={smoke_run}", "prompt=The game", f"checkpoint={other}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was trained with a vocabulary of 2005 ids" in err
    assert generate_cli.main([f"run_dir={smoke_run}", "prompt=The", "data.max_vocab=100"]) == 2
    assert "data.max_vocab cannot be changed" in capsys.readouterr().err
    assert generate_cli.main([f"run_dir={smoke_run}", "prompt=The", "top_k=many"]) == 2
    assert "top_k must be an integer" in capsys.readouterr().err


def _tiny_pcaf():
    model = ModelConfig(variant="pcaf", vocab_size=30, d_model=8, d_hidden=16, n_layers=1, kernel_size=3,
                        max_seq_len=16)
    memory = MemoryConfig(route="context", candidate_policy="recent", num_buckets=5, top_k=2)
    net = build_model(model, memory, get_profile("corrected"), seed=2, dtype=torch.float64)
    with torch.no_grad():  # a large ρ and a peaky gate so that the cache decides some tokens
        net.memory.recency_scale.fill_(3.0)
        net.gate.out.bias.fill_(2.0)
    return net.eval()


def test_greedy_generation_is_the_argmax_of_the_full_forward_over_its_output():
    """With the stream's window set to the final length, every greedy token is the argmax of the torch full
    AR forward over the generated sequence at the position before it."""
    net = _tiny_pcaf()
    prompt = torch.tensor([[3, 4, 3, 5], [7, 7, 8, 7]])
    out = generate(net, prompt, max_new_tokens=10, temperature=0.0, window=14)
    assert out.tokens.shape == (2, 14) and torch.equal(out.tokens[:, :4], prompt)
    with torch.no_grad():
        full = net(out.tokens, mode="ar")
    assert torch.equal(torch.argmax(full.log_probs[:, 3:-1], dim=-1), out.new_tokens)
    assert bool((full.memory.gate[:, 3:-1] > 0.5).any())  # the cache took part in the decisions


def test_sampling_is_reproducible_and_top_k_one_is_greedy():
    net = _tiny_pcaf()
    prompt = torch.tensor([[1, 2, 3]])
    a = generate(net, prompt, 8, temperature=1.0, seed=5).new_tokens
    b = generate(net, prompt, 8, temperature=1.0, seed=5).new_tokens
    assert torch.equal(a, b)
    greedy = generate(net, prompt, 8, temperature=0.0).new_tokens
    assert torch.equal(generate(net, prompt, 8, temperature=0.7, top_k=1, seed=9).new_tokens, greedy)
    assert torch.equal(generate(net, prompt, 8, temperature=0.7, top_p=1e-6, seed=9).new_tokens, greedy)


@pytest.mark.slow
def test_jax_generate_equals_torch_greedy_and_the_command_runs_on_jax(smoke_run, capsys):
    import jax

    from backends.jax import build_model as build_jax
    from backends.jax import to_variables
    from backends.jax.generate import generate as jax_generate
    from backends.torch import to_canonical

    net = _tiny_pcaf()
    prompt = np.array([[3, 4, 3, 5], [7, 7, 8, 7]])
    want = generate(net, torch.tensor(prompt), 10, temperature=0.0).new_tokens.numpy()
    with jax.enable_x64(True):
        module = build_jax(net.model_config, net.memory_config, net.profile, dtype=jax.numpy.float64)
        variables = to_variables(to_canonical(net), jax.numpy.float64)
        got = jax_generate(module, prompt, 10, temperature=0.0, variables=variables)
    np.testing.assert_array_equal(got.new_tokens, want)
    assert generate_cli.main([f"run_dir={smoke_run}", "prompt=The game", "max_new_tokens=5", "backend=jax",
                              "batch=2"]) == 0
    out = capsys.readouterr().out
    assert "continuation 1: " in out and "tokens/s (backend=jax, dtype=fp32, batch=2, 5 new tokens" in out


def test_only_the_vocabularys_ids_are_generated_on_either_backend():
    """A run's vocabulary may hold fewer words than the model's V (a small corpus of your own at
    data.max_vocab=20000): the ids past it name no word, so generation never draws them, greedy or sampled, and
    greedy otherwise picks what it would have picked."""
    import jax

    from backends.jax import build_model as build_jax
    from backends.jax import to_variables
    from backends.jax.generate import generate as jax_generate
    from backends.torch import to_canonical

    net = _tiny_pcaf()
    prompt = torch.tensor([[3, 4, 3, 5], [7, 7, 8, 7]])
    free = generate(net, prompt, 24, temperature=1.0, seed=1).new_tokens
    assert int(free.max()) >= 10  # without the limit, ids past it are drawn
    for temperature in (0.0, 1.0):
        limited = generate(net, prompt, 24, temperature=temperature, seed=1, vocab_limit=10).new_tokens
        assert int(limited.max()) < 10
    with torch.no_grad():
        greedy = generate(net, prompt, 6, temperature=0.0, window=10, vocab_limit=10).new_tokens
        full = net(torch.cat([prompt, greedy], dim=1), mode="ar").log_probs[:, 3:-1, :10]
    assert torch.equal(torch.argmax(full, dim=-1), greedy)
    with jax.enable_x64(True):
        module = build_jax(net.model_config, net.memory_config, net.profile, dtype=jax.numpy.float64)
        variables = to_variables(to_canonical(net), jax.numpy.float64)
        got = jax_generate(module, prompt.numpy(), 24, temperature=1.0, seed=1, variables=variables,
                           vocab_limit=10)
    assert int(np.max(got.new_tokens)) < 10
    with pytest.raises(ValueError, match=r"vocab_limit=31 must lie in \[1, 30\]"):
        generate(net, prompt, 2, vocab_limit=31)


def test_top_p_keeps_the_smallest_set_reaching_p():
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    drawn = {int(sample_next(lp, 1.0, 0, 0.75, g)) for _ in range(200)}
    assert drawn == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3
