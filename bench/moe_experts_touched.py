"""How many distinct experts one verify pass of T tree tokens touches in a Qwen3-MoE layer.

The verify pass reads the weights of every expert that at least one tree token routes to, so
its cost grows with that count, not with T. With routing independent across tokens and uniform
over E experts (top-k each), the expected count is E * (1 - (1 - k/E)^T). This script prints
that formula beside a simulation through the model's own router (`layers.moe`'s softmax + top-k)
with random weights and inputs. Real routing is correlated across the tokens of one text, so a
real model touches fewer experts: these figures are an upper bound, not a measurement of
Qwen3-30B-A3B (its weights are not available here).

  python bench/moe_experts_touched.py [--out bench/results/moe_experts_touched.md]
"""

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_io import write_text  # noqa: E402

from jetspec_jax.model import config  # noqa: E402

BUDGETS = (1, 16, 32, 64, 128, 256)


def expected_uniform(num_experts: int, top_k: int, tokens: int) -> float:
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def simulated(cfg, tokens: int, trials: int, key) -> float:
    """Mean distinct experts over trials of `tokens` random inputs through a random router."""
    k_router, k_x = jax.random.split(key)
    router = jax.random.normal(k_router, (cfg.hidden_size, cfg.num_experts)) / cfg.hidden_size**0.5
    x = jax.random.normal(k_x, (trials, tokens, cfg.hidden_size))
    probs = jax.nn.softmax(jnp.einsum("RTD,DE->RTE", x, router), axis=-1)
    _, experts = jax.lax.top_k(probs, cfg.experts_per_token)  # [R, T, k]
    hit = jnp.zeros((trials, cfg.num_experts), bool)
    hit = jax.vmap(lambda h, e: h.at[e.reshape(-1)].set(True))(hit, experts)
    return float(jnp.mean(jnp.sum(hit, axis=-1)))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the markdown table here")
    args = ap.parse_args()
    cfg = config.qwen3_30b_a3b()
    e, k = cfg.num_experts, cfg.experts_per_token
    per_expert_gb = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2 * cfg.num_layers / 1e9
    lines = [f"Qwen3-30B-A3B MoE layers: {e} experts, top-{k}, {cfg.num_layers} layers; one "
             f"expert's weights over all layers: {per_expert_gb:.2f} GB (bf16).", "",
             "| tree tokens T | experts touched per layer (uniform formula) | simulated, random "
             "router | expert GB read per verify | x a decode step's experts |",
             "|---|---|---|---|---|"]
    for t in BUDGETS:
        formula = expected_uniform(e, k, t)
        sim = simulated(cfg, t, trials=64, key=jax.random.key(t))
        lines.append(f"| {t} | {formula:.1f} | {sim:.1f} | {formula * per_expert_gb:.1f} | "
                     f"{formula / k:.1f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_text(args.out, text + "\n")


if __name__ == "__main__":
    np.set_printoptions(precision=2)
    main()
