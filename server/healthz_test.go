package server

import (
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

func TestHealthHandler(t *testing.T) {
	st := newCore(t, 4, Options{})
	srv := httptest.NewServer(st.HealthHandler())
	defer srv.Close()
	get := func() (int, string) {
		resp, err := srv.Client().Get(srv.URL + "/healthz")
		assert.NilError(t, err)
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	code, body := get()
	assert.Check(t, is.Equal(code, http.StatusOK))
	assert.Check(t, is.Equal(body, "ok\n"))
	assert.NilError(t, st.Close())
	code, body = get()
	assert.Check(t, is.Equal(code, http.StatusServiceUnavailable))
	assert.Check(t, is.Equal(body, "closed\n"))
}
