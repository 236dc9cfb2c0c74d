"""QK-clip (Kimi K2's MuonClip): the largest attention logits bounded after each optimizer step.

``Muon(params, qk_clip=QKClip(threshold=100.0))`` (or `NorMuon`) turns it on; the strategies
attach it to the model (`attach_qk_clip`). Layers: `settings` (the public setting), `logits` and
`heads` (pure per-layer logic), `transformers` (Hugging Face attention functions), `runtime`
(the collective and the rescaling).
"""

from lightning_canzona.qk_clip.heads import AttentionHeads, ClipsQueryKey, HeadRows
from lightning_canzona.qk_clip.logits import MaxLogits
from lightning_canzona.qk_clip.settings import QKClip

__all__ = ["AttentionHeads", "ClipsQueryKey", "HeadRows", "MaxLogits", "QKClip"]
