"""The drafters, one per file, each a :class:`~.base.Drafter` (:mod:`.base`) of a kind registered in
:mod:`.registry`: n-gram lookup over three caches (:mod:`.lookup`, :mod:`.ngram_cache`,
:mod:`.learned_cache`), suffix decoding (:mod:`.suffix`), a standalone draft model
(:mod:`.draft_model`), Gemma 4's MTP assistant (:mod:`.mtp`) and EAGLE-3 heads (:mod:`.eagle3`),
both over the head plumbing of :mod:`.linked_head`; what lookup and suffix keep in a file, through
:mod:`.saved_state`. Each proposes a draft; none verifies, samples the target or keeps acceptance
counters (the engine and the policy do)."""
