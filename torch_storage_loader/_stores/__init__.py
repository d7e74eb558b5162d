"""Object stores (s3:// through fsspec/obstore) and the cleaning of expired files."""
