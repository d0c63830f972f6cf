package l1

// evictOne drops the least recently used resident object that has no
// holds. Staging and temporary objects are never on the LRU list; held
// objects are skipped. It reports false when nothing is evictable.
func (c *Cache) evictOne() bool {
	for i := c.lru.tail; i != Nil; i = c.objs.get(i).prev {
		o := c.objs.get(i)
		if o.holds != 0 {
			continue
		}
		if c.cfg.OnEvict != nil {
			c.cfg.OnEvict(c.shards[o.shard].ns, o.rank, o.hash, o.size)
		}
		c.cnt.evictions++
		c.cnt.evictedBytes += o.size
		c.Free(i)
		return true
	}
	return false
}

// MaybeEvict runs watermark eviction: once the bytes in use pass the high
// watermark, evict LRU unheld resident objects until they are at or below
// the low watermark (or nothing evictable is left).
func (c *Cache) MaybeEvict() {
	capacity := float64(c.mem.capacity)
	if float64(c.mem.usedBytes) <= c.cfg.HighWatermark*capacity {
		return
	}
	low := uint64(c.cfg.LowWatermark * capacity)
	for c.mem.usedBytes > low && c.evictOne() {
	}
}

// Clear frees every resident object that has no holds and returns how
// many and their bytes. Staging, temporary and held objects stay.
func (c *Cache) Clear() (objects, bytes uint64) { return c.clear(NoShard) }

// ClearShard drops every resident object of shard sh that has no holds.
func (c *Cache) ClearShard(sh Shard) (objects, bytes uint64) { return c.clear(sh) }

// clear drops the unheld resident objects of sh (NoShard: of every shard).
func (c *Cache) clear(sh Shard) (objects, bytes uint64) {
	for i := c.lru.tail; i != Nil; {
		o := c.objs.get(i)
		prev := o.prev
		if o.holds == 0 && (sh == NoShard || o.shard == uint32(sh)) {
			objects++
			bytes += o.size
			c.Free(i)
		}
		i = prev
	}
	return objects, bytes
}
