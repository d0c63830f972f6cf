// Package adapters registers every built-in L2 adapter type (fs, redis,
// mooncake_store, plugin, s3) with package l2; import it for its side effect.
package adapters

import (
	_ "github.com/kvshim/kvshim/server/l2/fs"       // "fs"
	_ "github.com/kvshim/kvshim/server/l2/mooncake" // "mooncake_store"
	_ "github.com/kvshim/kvshim/server/l2/plugin"   // "plugin"
	_ "github.com/kvshim/kvshim/server/l2/redis"    // "redis"
	_ "github.com/kvshim/kvshim/server/l2/s3"       // "s3"
)
