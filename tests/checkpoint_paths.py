"""spec.checkpoint.path values and whether they are accepted: one table for the parser's
unit tests and the API server's admission tests, so the CRD's CEL rules and
lazarus_core/checkpoint_location.py are held to the same answers."""

ACCEPTED = [
    "/data/ckpt",
    "/data/ckpt/",
    "/",
    "file:///mnt/shared/ckpt",
    "s3://my-bucket",
    "s3://my-bucket/lazarus/gpt-s",
    "s3://my.bucket-1/a/b/c/",
    "gs://my_bucket/lazarus",
    "/data/.hidden/ckpt",
]

# (path, a word the refusal names)
REFUSED = [
    ("ckpt/run1", "relative"),
    ("./ckpt", "relative"),
    ("s3:/bucket/x", "relative"),
    ("S3://bucket/x", "relative"),
    ("hdfs://namenode/ckpt", "not supported"),
    ("http://minio:9000/bucket", "not supported"),
    ("file://relative/ckpt", "absolute path"),
    ("s3://Bucket/x", "bucket name"),
    ("s3://ab/x", "bucket name"),
    ("s3:///x", "bucket name"),
    ("/data/../etc", ".."),
    ("/data/..", ".."),
    ("s3://bucket/a/../../b", ".."),
    ("file:///data/./ckpt", "."),
    ("/data//ckpt", "empty segment"),
    ("s3://bucket//ckpt", "empty segment"),
    ("/data/ck pt", "whitespace"),
    ("s3://bucket/ckpt?versionId=1", "'?'"),
]
