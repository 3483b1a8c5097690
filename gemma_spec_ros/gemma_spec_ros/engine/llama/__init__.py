"""The llama.cpp layer: one model and its context (:mod:`.model`: load, tokenize, decode a batch
asking logits only for the rows that need them, roll the KV cache back), a prompt in the model's
own chat template (:mod:`.chat_prompt`), its vocabulary's identity (:mod:`.vocab`), one GGUF header
key (:mod:`.gguf`) and the process-wide llama.cpp state (:mod:`.process`). It knows no drafter, no
policy and no request."""
