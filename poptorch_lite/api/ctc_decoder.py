"""`poptorch.ctc_beam_search_decoder`: the most likely label sequences of CTC log-probabilities."""
from __future__ import annotations

import numbers

import torch
from torch.overrides import handle_torch_function, has_torch_function

from .errors import Error


def ctc_beam_search_decoder(probs: torch.Tensor, lengths: torch.Tensor, blank: int = 0, beam_width: int = 100,
                            top_paths: int = 1) -> list[torch.Tensor]:
    """Decode `probs` (log-probabilities [input_length, batch_size, num_classes]) of `lengths`
    frames per sample by CTC prefix beam search with `beam_width` beams; return the `top_paths`
    most likely paths of each sample: their log-probabilities [batch_size, top_paths], their
    lengths [batch_size, top_paths] and the paths [batch_size, top_paths, input_length] (padded
    with `blank`). On the IPU it is one op of the model (`ipusim.ops.ctc_decoder`); on the CPU the
    same search runs on the host (PopTorch's CPU fallback returns zeros)."""
    if not isinstance(probs, torch.Tensor):
        raise Error(f"ctc_beam_search_decoder: probs must be a torch.tensor argument. {type(probs)} is not supported.")
    if not isinstance(lengths, torch.Tensor):
        raise Error("ctc_beam_search_decoder: lengths must be a torch.tensor argument. "
                    f"{type(lengths)} is not supported.")
    for what, value in (("blank", blank), ("beam_width", beam_width), ("top_paths", top_paths)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise Error(f"ctc_beam_search_decoder: {what} must be an int, got {value!r}")
    if probs.dim() != 3:
        raise Error(f"Incorrect shape for first input to CTC beam search decoder: expected [input_length, batch_size, "
                    f"num_classes], got {list(probs.shape)}.")
    if not 0 <= blank < probs.shape[2]:
        raise Error(f"ctc_beam_search_decoder: blank must be a class in [0, {probs.shape[2]}), got {blank}")
    if not 1 <= top_paths <= beam_width:
        raise Error(f"ctc_beam_search_decoder: need 1 <= top_paths <= beam_width, got top_paths={top_paths}, "
                    f"beam_width={beam_width}")
    if has_torch_function((probs, lengths)):   # captured: one op (compiler/library.py)
        return list(handle_torch_function(ctc_beam_search_decoder, (probs, lengths), probs, lengths, int(blank),
                                          int(beam_width), int(top_paths)))
    from ipusim.ops.ctc_decoder import decode   # pylint: disable=import-outside-toplevel
    p, n, d = decode(probs.detach().float().numpy(), lengths.detach().numpy(), blank, beam_width, top_paths)
    return [torch.from_numpy(p), torch.from_numpy(n), torch.from_numpy(d)]
