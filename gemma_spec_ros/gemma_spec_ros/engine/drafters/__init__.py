"""The drafters, one per file, behind one protocol (:mod:`.base`): n-gram lookup over three caches
(:mod:`.lookup`, :mod:`.ngram_cache`, :mod:`.learned_cache`), a standalone draft model
(:mod:`.draft_model`), Gemma 4's MTP assistant (:mod:`.mtp`) and EAGLE-3 heads (:mod:`.eagle3`),
both over the head plumbing of :mod:`.linked_head`. Each proposes a draft; none verifies, samples
the target or keeps acceptance counters (the engine and the policy do)."""
