"""Reference solutions to tutorial 09's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them), and a
model answer to its question (at the end)."""


def mesh_coordinates(rank, dp, pp, tp):
    t = rank % tp  # tp fastest: blocks of tp neighbouring ranks
    d = rank // tp % dp  # then dp: a stage's dp blocks, one per replica
    p = rank // (tp * dp)  # pp slowest: one stage per tp · dp ranks
    return d, p, t


def stage_layers(n_layer, num_stages):
    return [n_layer // num_stages + (1 if s < n_layer % num_stages else 0) for s in range(num_stages)]


def gradient_group(rank, dp, pp, schedule):
    p = rank // dp  # tp = 1: rank = p · dp + d
    same = {p, pp - 1 - p} if schedule == "dualpipe" else {p}
    return sorted(q * dp + e for e in range(dp) for q in same)


def stage_model_states(n_layer, d_model, seq_len, vocab_size, dp, pp, zero):
    C = d_model
    per_block = 12 * C * C + 13 * C  # qkv 3C² + 3C, proj C² + C, fc 4C² + 4C, proj 4C² + C, two layer norms 4C
    result = []
    for s, blocks in enumerate(stage_layers(n_layer, pp)):
        psi = blocks * per_block
        if s == 0:
            psi += vocab_size * C + seq_len * C  # wte, wpe
        if s == pp - 1:
            psi += 2 * C + vocab_size * C  # ln_f, the head (no bias)
        whole = -(-psi // dp) * dp if zero else psi  # ZeRO's flat buffer, padded to a multiple of dp
        shard = whole // dp
        result.append({"parameters": 4 * whole, "gradients": 4 * (shard if zero >= 2 else whole),
                       "optimizer_states": 8 * (shard if zero >= 1 else whole)})  # AdamW: m and v
    return result


ANSWER = """
Model answer to the question (measure and explain).

(a) Pipeline rank 0 (Ψ = 26,016, float32 AdamW, dp = 2): ZeRO-1 halves the optimizer states (208,128 →
104,064 B), ZeRO-2 the gradients too (→ 52,032), ZeRO-3 the parameters too (→ 52,032). Yet the peak total
rises from 451,968 B (ZeRO-1) to 504,000 (ZeRO-2): `gradient_buckets` grows from 52,032 to 156,096. ZeRO-2
fills a transient whole bucket for each micro-batch's reduce-scatter, and here a stage is one 104 kB flat
group (under the 1 MiB default): the transient is the whole gradient, plus the shard. With a 1 GB stage it is
one or two 1 MiB buckets against 1 GB of whole gradients, and ZeRO-2 saves almost half of them.
(b) ZeRO-1 reduce-scatters once (52,032 B = 4Ψ(dp − 1)/dp) and all-gathers the updated parameters once:
2Ψ(dp − 1)/dp elements, data parallelism's all-reduce. ZeRO-2 reduce-scatters after every backward:
208,128 = m × 52,032, (m + 1)Ψ(dp − 1)/dp in all. ZeRO-3 also gathers the parameters for every forward and
backward: 468,464 B ≈ (2m + 1) × 52,032, 3mΨ(dp − 1)/dp in all. With m = 1 the three cost 2, 2 and 3; a
pipeline needs m ≫ pp to shrink its bubble, so ZeRO-2/3 multiply the dp traffic by about m/2 and 3m/2.
(c) 1F1B keeps pp − r micro-batches in flight (2 on rank 0, 1 on rank 1): predict 2, measure 139,776 / 74,756
= 1.87, because one micro-batch costs rank 1 4,868 B more (69,888 against 74,756): the final layer norm's
x̂ and 1/σ, the head's input and the loss's N·V probabilities. GPipe keeps all m = 4: 4 × 69,888 = 279,552
against 4 × 74,756 = 299,024, and the ratio flips to 0.93. zb1p leaves rank 0 at 139,776 (its peak is its
pp forwards in flight) but raises rank 1 to 116,036: deferred weight-gradient passes W keep the inputs they
need while the last stage already runs the next micro-batches.
"""
