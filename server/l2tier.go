package server

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/tier"
)

// l2Tier is the core's L2 side: the adapters and the two controllers.
type l2Tier struct {
	adapters []*l2.Adapter
	wr       *tier.Writer
	pc       *tier.PrefetchController
	segs     sync.WaitGroup // segment registrations running
}

// openTier opens the configured adapters (or takes o.L2Adapters) and
// wires the controllers; with none it installs o's hooks as given.
func (core *Core) openTier(o Options) (err error) {
	adapters := o.L2Adapters
	defer func() {
		if err != nil {
			for _, a := range adapters {
				_ = a.Close()
			}
		}
	}()
	if adapters == nil {
		for i, raw := range core.cfg.L2Adapters {
			a, err := l2.OpenJSON(raw, l2.Options{Registerer: core.metrics.reg})
			if err != nil {
				return fmt.Errorf("%w: --l2-adapter #%d: %w", ErrConfig, i+1, err)
			}
			adapters = append(adapters, a)
		}
	}
	if len(adapters) == 0 {
		core.filler, core.onCommit = o.Filler, o.OnCommit
		return nil
	}
	if o.Filler != nil || o.OnCommit != nil {
		return fmt.Errorf("%w: Options.Filler / OnCommit cannot be combined with L2 adapters", ErrConfig)
	}
	policy, err := tier.ParseStorePolicy(core.cfg.L2StorePolicy)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	prefetchBudget, storeBytes := core.cfg.l2Budgets()
	hints := &tier.SizeHints{}
	log := slog.Default().With("component", "l2tier")
	t := &l2Tier{adapters: adapters}
	t.pc, err = tier.NewPrefetchController(core, adapters, tier.PrefetchConfig{
		Budget: prefetchBudget, Timeout: core.cfg.L2PrefetchTimeout, AdmissionWait: core.cfg.L2AdmissionWait,
		Retain: core.cfg.L2PrefetchRetain, Hints: hints, BeforeLoad: o.L2BeforeLoad,
	}, core.metrics.reg, log)
	if err != nil {
		return err
	}
	t.wr, err = tier.NewWriter(core, adapters, tier.WriterConfig{
		Policy: policy, MaxBytes: storeBytes, Hints: hints, OnStored: core.l2Stored,
	}, core.metrics.reg, log)
	if err != nil {
		return err
	}
	for _, a := range adapters {
		if dn, ok := a.Backend().(l2.DropNotifier); ok {
			dn.OnDrop(core.l2Dropped) // KV events: STORAGE removed (events.go)
		}
	}
	core.tier = t
	core.filler = t.pc
	if !tier.IsNone(policy) {
		core.onCommit = t.wr.Committed
	}
	if src, ok := core.l1.Source().(*IPCSource); ok {
		src.setOnNew(t.registerSegment)
	}
	return nil
}

// registerSegment announces a new L1 segment to every adapter in the
// background (it is called under the core's lock; a backend that needs
// registration — mooncake_store — moves buffers of a segment it does not
// know yet through its bounce buffer meanwhile).
func (t *l2Tier) registerSegment(seg *ipc.Segment) {
	t.segs.Add(1)
	go func() {
		defer t.segs.Done()
		for _, a := range t.adapters {
			if err := a.RegisterL1Segment(seg.Fd(), seg.Mem()); err != nil {
				slog.Warn("l2tier: register L1 segment", "adapter", a.Name(), "segment", seg.ID(), "err", err)
			}
		}
	}()
}

// close stops the controllers (prefetches answer, writes end or time out),
// then closes the adapters.
func (t *l2Tier) close() error {
	t.pc.Close()
	t.wr.Close()
	t.segs.Wait()
	var errs []error
	for _, a := range t.adapters {
		errs = append(errs, a.Close())
	}
	return errors.Join(errs...)
}

// L2Adapters are the core's L2 adapters (nil: L1 only).
func (core *Core) L2Adapters() []*l2.Adapter {
	if core.tier == nil {
		return nil
	}
	return core.tier.adapters
}

// Writer is the L2 writer (nil: L1 only).
func (core *Core) Writer() *tier.Writer {
	if core.tier == nil {
		return nil
	}
	return core.tier.wr
}

// PrefetchController is the L2 prefetch controller (nil: L1 only).
func (core *Core) PrefetchController() *tier.PrefetchController {
	if core.tier == nil {
		return nil
	}
	return core.tier.pc
}
