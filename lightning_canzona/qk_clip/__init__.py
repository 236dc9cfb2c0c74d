"""QK-clip (Kimi K2's MuonClip): the largest attention logits bounded after each optimizer step.

``Muon(params, qk_clip=QKClip(threshold=100.0))`` (or `NorMuon`) turns it on; the strategies
attach it to the model (`lightning_canzona.qk_clip_runtime.attach_qk_clip`, which runs the
collective and the rescaling). This package is the pure part, free of ``torch.distributed``:
`settings` (the public setting), `logits` and `heads` (per-layer logic), `transformers` (Hugging
Face attention functions).
"""

from lightning_canzona.qk_clip.heads import AttentionHeads, ClipsQueryKey, HeadRows
from lightning_canzona.qk_clip.logits import MaxLogits
from lightning_canzona.qk_clip.settings import QKClip

__all__ = ["AttentionHeads", "ClipsQueryKey", "HeadRows", "MaxLogits", "QKClip"]
