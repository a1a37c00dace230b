"""`verify`'s one printer, for both formats: what the integrity check read (the one part each format says its own
way), the non-finite values, and with --against the logits, what was compared directly, the streamed per-layer rows
(each named: `compared`) and the first layer beyond the tolerance; then the one `shardkit: error:` line of a
checkpoint that fails."""
from __future__ import annotations


def print_report(result: dict, against: str | None) -> None:
    """The human-readable report of `verify_checkpoint`'s result on stdout."""
    if result.get("format") == "torch_dist":
        _torch_dist_lines(result)
    else:
        _native_lines(result)
    for name, count in result["nonfinite"].items():
        print(f"  {name}: {count:,} non-finite value(s) (NaN/Inf)")
    if "parity" in result:
        _parity_lines(result["parity"], against, result["ok"])


def _native_lines(result: dict) -> None:
    print(f"{result['path']}: {result['tensors']} tensors, {result['chunks']} chunks, {result['bytes']:,} bytes: "
          "all checksums OK, manifest matches the arrays")
    if not result.get("chunk_positions_checked", True):
        print("note: this manifest records no per-chunk crc32c (written by an older shardkit): each chunk's own "
              "checksum was checked, but not that it sits in its place; rewrite it (reshard) to record them")


def _torch_dist_lines(result: dict) -> None:
    lay = result["layout"]
    print(f"{result['path']}: torch_dist, iteration {result['iteration']}, tp={lay['tp']} pp={lay['pp']} "
          f"vpp={lay['vpp']} ep={lay['ep']} (layout from {result['layout_from']}; model from {result['model_from']})")
    print(f"  {result['tensors']} tensors, {result['items']} items in {result['files']} files, "
          f"{result['bytes']:,} bytes: every item read"
          + (", keys and global shapes match the model config and every item lies in one rank's shard"
             if result["keys_ok"] else ""))
    for what in ("missing", "unexpected"):
        if result[what]:
            print(f"  {what} ({len(result[what])}): {', '.join(result[what])}")
    for line in result["problems"]:
        print(f"  {line}")


def _parity_lines(p: dict, against: str, ok: bool) -> None:
    """`ok`: the checkpoint's verdict (FAIL also where the logits agree but a weight holds NaN/Inf)."""
    print(f"logits vs {against} (fp32, {p['batch']}x{p['seq_len']} random tokens): max |diff| = "
          f"{p['max_abs_diff']:.3e} (tolerance {p['tolerance']:.0e}): {'OK' if ok else 'FAIL'}")
    e = p.get("embedding")  # what was compared directly, and every parameter neither exercised nor compared
    if e:
        print(f"  {e['tensor']}: all {e['rows']} rows compared with HF's bit for bit (after the cast): "
              + (f"{e['rows_differ']} differ" if e["rows_differ"] else "equal"))
    for what in p.get("not_compared") or []:
        print(f"  not exercised or compared: {what}")
    if p["mode"] == "streaming":
        moe = [r for r in p["layers"] if "experts" in r]
        tol = p["tolerance"]
        print(f"  streamed layer by layer (each on HF's hidden state): {compared(p)}; worst |diff| "
              f"{max(max(r.get(k, 0) for k, _ in _ROW_DIFFS) for r in p['layers']):.3e}"
              + (f"; experts exercised {sum(r['experts_exercised'] for r in moe)}/"
                 f"{sum(r['experts'] for r in moe)}" if moe else ""))
        for r in p["layers"]:
            # every number the verdict holds against a row (streamed.py's _beyond): an MTP layer's eh_proj input and
            # its logits too, else its failure was a FAIL with no row named and a worst |diff| of 0
            if not (all(r.get(k, 0) <= tol for k, _ in _ROW_DIFFS) and r.get("expert_max_abs_diff", 0) <= tol):
                where = row_label(r["layer"]) + (f", expert {r['expert']} ({r['expert_max_abs_diff']:.3e})"
                                                 if "expert" in r else "")
                also = "".join(f", {what} {r[k]:.3e}" for k, what in _ROW_DIFFS[1:] if k in r and not r[k] <= tol)
                print(f"  {where}: |diff| {r['max_abs_diff']:.3e}{also} beyond the tolerance")


# a streamed row's differences: its output on HF's input, and an MTP layer's eh_proj output and logits
_ROW_DIFFS = (("max_abs_diff", None), ("eh_proj_max_abs_diff", "eh_proj"), ("logits_max_abs_diff", "logits"))


def row_label(layer) -> str:
    """A streamed row's name as every line says it: 'decoder layer 3', 'MTP layer 0', 'embedding', 'head'."""
    if isinstance(layer, int):
        return f"decoder layer {layer}"
    return f"MTP layer {layer.split('.', 1)[1]}" if str(layer).startswith("mtp.") else str(layer)


def first_beyond(p: dict) -> str | None:
    """'decoder layer 2 (expert 5)': the first row beyond the tolerance, as the error lines name it (None: none)."""
    layer = p.get("first_layer_beyond_tolerance")
    if layer is None:
        return None
    expert = p.get("first_expert_beyond_tolerance")
    return row_label(layer) + (f" (expert {expert})" if expert is not None else "")


def compared(p: dict) -> str:
    """What the proof compared, every row named: 'embedding, decoder layers 0-60, head, MTP layer 0' (streamed) or
    'the final logits (whole model)' (`convert`'s line and `verify`'s report both say it)."""
    if p.get("mode") != "streaming":
        return "the final logits (whole model)"
    names, run = [], []  # consecutive decoder layers as one range

    def flush() -> None:
        if run:
            names.append(f"decoder layer {run[0]}" if len(run) == 1 else f"decoder layers {run[0]}-{run[-1]}")
            run.clear()

    for r in p["layers"]:
        layer = r["layer"]
        if isinstance(layer, int) and (not run or layer == run[-1] + 1):
            run.append(layer)
            continue
        flush()
        if isinstance(layer, int):
            run.append(layer)
        else:
            names.append(row_label(layer))
    flush()
    return ", ".join(names)


def error_line(result: dict, against: str | None, tolerance: float) -> str | None:
    """Why the checkpoint fails verify, in one line (without the `shardkit: error: ` prefix); None when it passes:
    a torch_dist checkpoint whose keys or shapes do not fit the model, non-finite values, a weight compared directly
    that differs while the logits agree, the first layer beyond the tolerance (streamed), or the logits."""
    if not result.get("keys_ok", True):
        first = (result["problems"] or [None])[0]
        if result["missing"] or result["unexpected"]:
            first = (f"{result['path']}: {len(result['missing'])} tensor(s) the model config "
                     f"({result['model_from']}) needs are missing"
                     + (f" (e.g. {result['missing'][0]})" if result["missing"] else "")
                     + f", {len(result['unexpected'])} stored tensor(s) are not part of it"
                     + (f" (e.g. {result['unexpected'][0]})" if result["unexpected"] else ""))
        return first
    bad = result["nonfinite"]
    if bad:
        first = next(iter(bad))
        return (f"{len(bad)} tensor(s) hold non-finite values (NaN/Inf), e.g. {first} ({bad[first]:,}); this "
                "checkpoint cannot be trained or exported as it is: resume from an earlier iteration")
    p = result.get("parity")
    if p is None or p["ok"]:
        return None
    if p.get("weights_differ") and p["max_abs_diff"] <= tolerance and p.get("layers_ok", True):
        # the logits agree, a weight compared directly does not (issue 34: an embedding row no test token reads)
        return f"{p['weights_differ']} ({against}); the checkpoint does not reproduce that model"
    also = f" (and {p['weights_differ']})" if p.get("weights_differ") else ""
    first = first_beyond(p)
    if first is not None:
        return (f"{first} is the first to differ from {against} beyond {tolerance:.0e} (on HF's own input of "
                f"that layer){also}; the checkpoint does not reproduce that model")
    return (f"logits differ from {against} by {p['max_abs_diff']:.3e} > {tolerance:.0e}{also}; the checkpoint does "
            "not reproduce that model")
