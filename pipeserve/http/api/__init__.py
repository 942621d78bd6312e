"""Protocol adapters: HTTP bodies ⇄ the protocol-neutral Request and its events."""
