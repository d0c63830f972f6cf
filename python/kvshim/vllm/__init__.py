"""kvshim as a vLLM v1 KV connector (``kv_connector_module_path: "kvshim.vllm"``),
shaped like vLLM's OffloadingConnector: connector.py hands each call to its
role's object, scheduler.py (KVShimScheduler) or worker.py (KVShimWorker);
config.py reads kv_connector_extra_config; stats.py holds the step metadata
and the stats. Importing it loads nothing native."""

from kvshim.vllm.config import LOGGER_NAME, connector_config, read_config
from kvshim.vllm.connector import KVShimConnector
from kvshim.vllm.scheduler import KVShimScheduler, _extras
from kvshim.vllm.stats import KVShimMetadata, KVShimStats
from kvshim.vllm.worker import KVShimWorker

__all__ = [
    "LOGGER_NAME", "KVShimConnector", "KVShimMetadata", "KVShimScheduler", "KVShimStats", "KVShimWorker",
    "_extras", "connector_config", "read_config",
]
