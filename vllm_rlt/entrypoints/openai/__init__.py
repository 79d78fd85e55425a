"""The OpenAI-compatible server: protocol models, serving code, and the FastAPI app."""
