"""The decoder-layer families coat.convert converts that differ from Llama's, one module each."""
