"""`kvplan plan`: plan one job in this process (no service) and show the plan — a per-layer table,
the proto's JSON form (`--json`), or a bar chart of kept tokens per layer (`--plot`). The table's
`kept` column and the bars are one number, `kept` (`kvcore.plan_cost.kept_per_head`: sinks,
window and the scored tokens, `keep_tokens`), the bar's lighter part the sinks and window.

The strategy is a shipped one's name or a definition file. The prompt is `--tokens N` tokens
long, or a file tokenized as the executor would (one user message); a probing strategy then
probes it here, with the model loaded in process, and `--predict` probes it for any strategy to
fill the plan's two predicted retained-attention figures (planner/predict.py)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from kvcore.config import ModelConfig
from kvcore.plan import CompressionPlan, LayerPlan

COLOURS = {"full": "#9e9e9e", "evicted": "#1f77b4", "codebook": "#ff7f0e", "merge": "#2ca02c", "quant": "#9467bd"}


class BadInput(ValueError):
    """Exit code 2."""


def strategy(spec: str):
    """A shipped strategy by name, or the one a definition file (JSON/YAML) defines."""
    from kvcore.request import InvalidRequest
    from planner.strategies import STRATEGIES, build, parse
    if spec in STRATEGIES:
        return STRATEGIES[spec]
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".json") or path.is_file():
        try:
            return build(parse(path.read_text()))
        except OSError as e:
            raise BadInput(f"--strategy: {e.strerror}: {spec}") from None
        except InvalidRequest as e:
            raise BadInput(f"{spec}: {e}") from None
    raise BadInput(f"--strategy: unknown strategy {spec!r} (known: {', '.join(sorted(STRATEGIES))}; "
                   "or give a definition file)")


def make(spec: str, mcfg: ModelConfig, ratio: float | None, kv_tokens: int | None, tokens: int,
         prompt: str | None, predict: bool = False, new_tokens: int = 0,
         say=lambda what: None, question: str = "") -> tuple[CompressionPlan, int, str]:
    """-> (the plan, the prompt's tokens, why a job asking this budget would be refused: "" when
    it would run — `planner.fit`, as the planner service judges it). `say(what)`: each slow
    step as it starts (the model's shape, the probe). `question`: prefilled after the compressed
    prompt, as `generate --question` (its tokens come out of the budget too)."""
    from kvcore.request import InvalidRequest
    from planner.request import PlanInput
    s = strategy(spec)
    if ratio is not None and not 0.0 < ratio <= 1.0:
        raise BadInput(f"--ratio: must be in (0, 1], got {ratio:g}")
    if kv_tokens is not None and kv_tokens < 1:
        raise BadInput(f"--kv-tokens: must be >= 1, got {kv_tokens}")
    if tokens < 1:
        raise BadInput(f"--tokens: must be >= 1, got {tokens}")
    if new_tokens < 0:
        raise BadInput(f"--new-tokens: must be >= 0, got {new_tokens}")
    if predict and prompt is None:
        raise BadInput("--predict: probes the prompt: give --prompt-file")
    if question and prompt is None:
        raise BadInput("--question: follows the prompt: give --prompt-file")
    say("reading the model's shape (a first run converts the model)")
    shape, path = _shape(mcfg)
    ids, suffix = _tokenize(path, prompt, question) if prompt is not None else (None, 0)
    probe = None
    if ids:
        from planner.probe import Prober, in_mode, once
        prober = Prober(mcfg)

        def probing(*a, **kw):
            say(f"loading the model and probing the prompt's {len(ids)} tokens")
            return prober.probe(*a, **kw)
        probe = once(probing, ids)
    inp = PlanInput(job_id="cli", strategy=s.name, prompt_tokens=len(ids) if ids is not None else tokens,
                    model=shape, reserve_ratio=ratio if kv_tokens is None else None, kv_tokens=kv_tokens,
                    new_tokens=new_tokens, suffix_tokens=suffix,
                    probe=in_mode(probe, s.probe_mode) if probe and s.probe_mode else None)
    from planner import fit, precheck
    try:
        plan = s.plan(inp, "local")
        refused = "" if fit.usable(plan, inp) else \
            str(fit.refusal(lambda i: s.plan(i, "local"), inp, plan, precheck.note(s, plan)))
    except InvalidRequest as e:
        if e.field == "token_ids" and ids is None:
            raise BadInput(f"--prompt-file: strategy {s.name} probes the prompt: give --prompt-file") from None
        raise BadInput(f"--prompt-file: {e}" if e.field == "token_ids" else str(e)) from None
    if predict and ids:
        from planner.predict import from_probe
        plan = from_probe(plan, probe, shape)
    return dataclasses.replace(plan, strategy=s.name, strategy_version=s.version), inp.prompt_tokens, refused


def _shape(mcfg: ModelConfig):
    """The model's shape from its config (no weights loaded) and its folder."""
    from transformers import AutoConfig
    from kvcore import model
    from planner.request import ModelShape
    path = model.prepare(mcfg)
    c = AutoConfig.from_pretrained(path)
    heads = c.num_attention_heads
    return ModelShape(num_layers=c.num_hidden_layers, num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                      num_query_heads=heads, head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                      fingerprint=model.fingerprint(path)), path


def _tokenize(path: Path, text: str, question: str = "") -> tuple[list[int], int]:
    """The prompt's context ids as the executor builds them (one user message), and the tokens
    prefilled after it (`question` and the chat template's assistant prompt; 0 without one)."""
    from transformers import AutoTokenizer
    from executor.prompt import build
    got = build(AutoTokenizer.from_pretrained(path), [{"role": "user", "content": text}], question)
    return got.context_ids, len(got.question_ids)


def kept(lp: LayerPlan, prompt_tokens: int) -> int:
    """Prompt tokens a layer keeps per stored head: its sinks, window and scored tokens (the
    whole prompt without eviction) — what the executor keeps (`kvcore.plan_cost`)."""
    from kvcore.plan_cost import kept_per_head
    return kept_per_head(lp, prompt_tokens)


def always(lp: LayerPlan, prompt_tokens: int) -> int:
    """Of `kept`, the sinks and window, kept whatever the scores (0 without eviction)."""
    ev = lp.eviction
    return min(prompt_tokens, ev.sink_tokens + ev.window) if ev else 0


def table(plan: CompressionPlan, prompt_tokens: int) -> str:
    head = (f"{plan.strategy} v{plan.strategy_version}: {prompt_tokens} prompt tokens, predicted reserve ratio "
            f"{plan.predicted_reserve_ratio:.3f}"
            + (f", retained attention {plan.predicted_retained_attention:.3f}"
               if plan.predicted_retained_attention < 1.0 else "")
            + (f", copy-aware {plan.predicted_copy_retained_attention:.3f}"
               if plan.predicted_copy_retained_attention < 1.0 else ""))
    rows = [f"{'layer':>5} {'kind':<8} {'kept':>5} {'keep_tokens':>11} {'window':>6} {'sinks':>5} "
            f"{'codebook θk/θv':<14} {'merge':<22} {'quant':<14} kvcrush"]
    for lp in plan.layers:
        ev, cb, mg, q = lp.eviction, lp.codebook, lp.merge, lp.quant
        rows.append(" ".join([
            f"{lp.layer:>5}", f"{lp.kind:<8}", f"{kept(lp, prompt_tokens):>5}",
            f"{kept(lp, prompt_tokens) - always(lp, prompt_tokens) if ev else 'all':>11}",
            f"{ev.window if ev else '-':>6}", f"{ev.sink_tokens if ev else '-':>5}",
            f"{f'{cb.theta_k:.2f}/{cb.theta_v:.2f}' if cb else '-':<14}",
            f"{f'with {mg.with_layer}, t {mg.t:g}, γ {mg.retention_k:g}/{mg.retention_v:g}' if mg else '-':<22}",
            f"{f'{q.bits}b g{q.group_size} r{q.residual}' if q else '-':<14}",
            f"{ev.kvcrush.rep_fraction:g} {ev.kvcrush.anchor}" if ev and ev.kvcrush else "-",
        ]))
    off = plan.offload
    if off.enabled:
        rows.append(f"offload (SpeCache; plain layers): {off.low_bits}-bit copy, keys per {off.group_size} tokens, "
                    f"values per {off.value_group_size} channels, window {off.recent_window}, top-k {off.top_k} "
                    f"(re-ranked from {off.candidates} candidates), sinks {off.sink_tokens}; the executor fits these to the job's budget")
    rows.append("kept: prompt tokens kept per KV head (sinks + window + keep_tokens, the scored ones; what "
                "--plot draws)")
    return "\n".join([head, *rows])


def as_json(plan: CompressionPlan) -> str:
    from google.protobuf.json_format import MessageToJson
    return MessageToJson(plan.to_proto(), preserving_proto_field_name=True)


def need_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise BadInput("--plot needs matplotlib: pip install 'kvplan[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot(plan: CompressionPlan, prompt_tokens: int, out: Path, asked: str = "") -> list[int]:
    """Bars of kept tokens per head per layer (the table's `kept`), coloured by kind, the sinks
    and window lighter at their foot; each bar of a plan that quantizes says its layer's bits
    (`auto` mixes 16/8/4/2); the title gives the prompt's length, the budget asked (`asked`, e.g.
    "ratio 0.2") and the predicted reserve ratio. -> the bars' heights, in layer order."""
    plt = need_matplotlib()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * len(plan.layers)), 3.8))
    kinds = [lp.kind for lp in plan.layers]
    heights = [kept(lp, prompt_tokens) for lp in plan.layers]
    floors = [always(lp, prompt_tokens) for lp in plan.layers]
    xs, colours = [lp.layer for lp in plan.layers], [COLOURS.get(k, "#000000") for k in kinds]
    ax.bar(xs, floors, color=colours, alpha=0.4)
    ax.bar(xs, [h - f for h, f in zip(heights, floors)], bottom=floors, color=colours)
    from matplotlib.patches import Patch
    handles = [Patch(color=COLOURS.get(k, "#000000"), label=k) for k in dict.fromkeys(kinds)]
    if any(floors):
        handles.append(Patch(color="#000000", alpha=0.4, label="sinks + window"))
    if any(lp.quant for lp in plan.layers):
        for lp, h in zip(plan.layers, heights):
            ax.text(lp.layer, h, f"{lp.quant.bits if lp.quant else 16}", ha="center", va="bottom", fontsize=7)
        ax.set_ylim(top=max(heights) * 1.12)
    ax.set(xlabel="layer" + (" (bar labels: bits per stored value)" if any(lp.quant for lp in plan.layers) else ""),
           ylabel="kept tokens per head",
           title=f"{plan.strategy} v{plan.strategy_version}: {prompt_tokens} prompt tokens"
                 + (f", asked {asked}" if asked else "") + f", predicted reserve {plan.predicted_reserve_ratio:.3f}")
    ax.legend(handles=handles, fontsize="small", loc="lower left")
    fig.tight_layout()
    fig.savefig(out)
    drawn = [round(sum(p.get_height() for p in ax.patches if abs(p.get_x() + p.get_width() / 2 - x) < 1e-6))
             for x in xs]                                                   # read back: what the image shows
    plt.close(fig)
    return drawn
