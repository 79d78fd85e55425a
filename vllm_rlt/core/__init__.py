"""Host-side engine core: KV block accounting and scheduling. Imports no torch."""
