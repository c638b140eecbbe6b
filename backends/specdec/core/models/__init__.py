"""Model code: the Llama-family target/draft, the KV cache, and the Medusa/EAGLE heads."""
