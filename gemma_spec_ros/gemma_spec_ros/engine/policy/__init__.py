"""How long to draft: the measured cost model (:mod:`.costs`, seeded at load by :mod:`.calibration`),
measured acceptance per position and per evidence class (:mod:`.acceptance`), the draft-length
policy that maximises predicted tokens per second (:mod:`.length`), and the hindsight that settles
every draft against the tokens the request then emitted (:mod:`.hindsight`)."""
