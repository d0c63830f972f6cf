// Package cli implements the kvshim command line (doctor, serve, stat). The
// same code runs from the Python console entry, through kvshim_main in
// libkvshim.so, so the wheel ships one native artefact.
package cli
