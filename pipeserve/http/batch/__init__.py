"""OpenAI's Files and Batch APIs: JSONL files stored on disk, and batches whose lines run
through the server's own endpoints at the least urgent priority, resumed after a restart."""
